"""``ContextPhaseParams``: what the context (prefill) phase hands the generation (decode) phase.

It is tensorrtllm_backend's ``context_phase_params`` output, here: the NIXL agent name and metadata of the
prefill side, the address of the registered region that holds the prompt's history, its layout, the first
token and the prefill timings. It travels as bytes (Triton: a ``UINT8`` tensor) through the orchestrator;
the bulk rows never do: the decode side READs them from the region over NIXL.

Region layout (one registered host buffer on the prefill side, offsets in bytes, each 64-byte aligned)::

    rows      [num_sources, prompt_len, row_dim]      rows_dtype
    keys[l]   [prompt_len, index_key_dim]             rows_dtype, one block per indexer layer (sorted)
    features  [feature_rows, feature_dim]             float32 (drafter context; absent without a drafter)

Wire format: ``b"DHCP"`` + uint32 header length (little endian) + JSON header + the agent metadata bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

MAGIC = b"DHCP"
ALIGN = 64
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported row dtype {dtype}")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


@dataclass(frozen=True)
class RegionLayout:
    """Byte layout of the prefill side's region (see the module docstring)."""

    num_sources: int
    prompt_len: int
    row_dim: int
    rows_dtype: str
    key_layers: tuple[int, ...]
    index_key_dim: int
    feature_rows: int = 0
    feature_dim: int = 0

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=DTYPES[self.rows_dtype]).element_size()

    @property
    def row_bytes(self) -> int:
        return self.row_dim * self.element_bytes

    @property
    def rows_bytes(self) -> int:
        return self.num_sources * self.prompt_len * self.row_bytes

    @property
    def key_bytes(self) -> int:
        return self.prompt_len * self.index_key_dim * self.element_bytes

    @property
    def meta_offset(self) -> int:
        """Where keys and features start (everything after the rows)."""
        return _aligned(self.rows_bytes)

    def key_offset(self, layer: int) -> int:
        return self.meta_offset + self.key_layers.index(layer) * _aligned(self.key_bytes)

    @property
    def features_offset(self) -> int:
        return self.meta_offset + len(self.key_layers) * _aligned(self.key_bytes)

    @property
    def features_bytes(self) -> int:
        return self.feature_rows * self.feature_dim * 4

    @property
    def total_bytes(self) -> int:
        return self.features_offset + self.features_bytes

    def pack(self, buf: torch.Tensor, rows: torch.Tensor, keys: dict[int, torch.Tensor],
             features: torch.Tensor | None) -> None:
        """Write rows, keys and features at their offsets into ``buf`` (uint8, CPU, ``total_bytes`` long)."""
        dtype = DTYPES[self.rows_dtype]
        buf[: self.rows_bytes] = rows.detach().to("cpu", dtype).contiguous().view(-1).view(torch.uint8)
        for layer in self.key_layers:
            off = self.key_offset(layer)
            buf[off : off + self.key_bytes] = keys[layer].detach().to("cpu", dtype).contiguous().view(-1) \
                .view(torch.uint8)
        if features is not None and self.features_bytes:
            off = self.features_offset
            buf[off : off + self.features_bytes] = features.detach().to("cpu", torch.float32).contiguous() \
                .view(-1).view(torch.uint8)

    def unpack_rows(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[: self.rows_bytes].view(DTYPES[self.rows_dtype]).view(self.num_sources, self.prompt_len,
                                                                          self.row_dim)

    def unpack_keys(self, buf: torch.Tensor, base: int = 0) -> dict[int, torch.Tensor]:
        """Keys from ``buf`` whose byte 0 is region offset ``base``."""
        dtype = DTYPES[self.rows_dtype]
        out = {}
        for layer in self.key_layers:
            off = self.key_offset(layer) - base
            out[layer] = buf[off : off + self.key_bytes].view(dtype).view(self.prompt_len, self.index_key_dim)
        return out

    def unpack_features(self, buf: torch.Tensor, base: int = 0) -> torch.Tensor | None:
        if not self.features_bytes:
            return None
        off = self.features_offset - base
        return buf[off : off + self.features_bytes].view(torch.float32).view(self.feature_rows, self.feature_dim)


@dataclass(frozen=True)
class ContextPhaseParams:
    """Everything the generation phase needs to import a request's history (see the module docstring)."""

    request_key: str  # unique per context request; the NIXL notification that releases the region
    agent_name: str
    region_addr: int  # address of the registered region in the prefill process
    layout: RegionLayout
    first_token: int
    seed: int  # int64 bit pattern of the request's random stream (sampled requests continue it)
    queue_s: float = 0.0  # prefill side: arrival → prefill start
    prefill_s: float = 0.0
    hold_deadline_s: float = 0.0  # the prefill side frees the region this long after publishing
    agent_metadata: bytes = field(default=b"", repr=False)

    def to_bytes(self) -> bytes:
        header = asdict(self)
        header.pop("agent_metadata")
        header["layout"]["key_layers"] = list(self.layout.key_layers)
        text = json.dumps(header).encode()
        return MAGIC + struct.pack("<I", len(text)) + text + self.agent_metadata

    def to_numpy(self) -> np.ndarray:
        """``UINT8`` tensor ``[1, N]`` for Triton."""
        return np.frombuffer(self.to_bytes(), dtype=np.uint8).reshape(1, -1).copy()

    @classmethod
    def from_bytes(cls, data: bytes | np.ndarray) -> ContextPhaseParams:
        raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        if len(raw) < 8 or raw[:4] != MAGIC:
            raise ValueError("context_phase_params: not a DHiSparse context phase (bad magic)")
        (size,) = struct.unpack("<I", raw[4:8])
        if len(raw) < 8 + size:
            raise ValueError("context_phase_params: truncated header")
        try:
            header = json.loads(raw[8 : 8 + size])
            layout = header.pop("layout")
            layout["key_layers"] = tuple(layout["key_layers"])
            return cls(layout=RegionLayout(**layout), agent_metadata=raw[8 + size :], **header)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"context_phase_params: malformed header ({error})") from error
