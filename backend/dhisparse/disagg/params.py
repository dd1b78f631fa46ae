"""``ContextPhaseParams``: what the context (prefill) phase hands the generation (decode) phase.

It is tensorrtllm_backend's ``context_phase_params`` output, here: the NIXL agent name and metadata of the
prefill side, the address of the registered region that holds the prompt's history, its layout, the first
token and the prefill timings. It travels as bytes (Triton: a ``UINT8`` tensor) through the orchestrator;
the bulk rows never do: the decode side READs them from the region over NIXL.

Region layout (one registered host buffer on the prefill side, offsets in bytes, each 64-byte aligned)::

    rows      [num_sources, prompt_len, row_dim]      rows_dtype
    keys[l]   [prompt_len, index_key_dim]             rows_dtype, one block per indexer layer (sorted)
    features  [feature_rows, feature_dim]             float32 (drafter context; absent without a drafter)

Wire format: ``b"DHC2"`` + uint32 header length (little endian) + JSON header + the agent metadata bytes + a
32-byte HMAC-SHA256 tag over everything before it, keyed by the deployment's internal key (the context and
generation roles share it: ``internal_auth.py``). ``from_bytes`` checks the tag before it parses anything, then
checks every field's type and range, so a forged, altered or malformed input is one ``ValueError`` that names the
problem; the generation side then checks the layout against its own engine (``trust.check_context``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

MAGIC = b"DHC2"
ALIGN = 64
TAG_BYTES = 32
MAX_HEADER_BYTES = 1 << 16
MAX_METADATA_BYTES = 1 << 20
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported row dtype {dtype}")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _integer(owner: str, name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{owner}: {name} must be an integer in [{low}, {high}], got {value!r}")


def _seconds(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


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

    def __post_init__(self) -> None:
        owner = "context_phase_params layout"
        for name, high in (("num_sources", 1 << 12), ("prompt_len", 1 << 24), ("row_dim", 1 << 16),
                           ("index_key_dim", 1 << 16), ("feature_rows", 1 << 24), ("feature_dim", 1 << 20)):
            _integer(owner, name, getattr(self, name), 1 if name in ("num_sources", "prompt_len", "row_dim") else 0,
                     high)
        if not isinstance(self.rows_dtype, str) or self.rows_dtype not in DTYPES:
            raise ValueError(f"{owner}: rows_dtype must be one of {', '.join(DTYPES)}, got {self.rows_dtype!r}")
        if not isinstance(self.key_layers, tuple):
            raise ValueError(f"{owner}: key_layers must be a list of layer indices")
        for layer in self.key_layers:
            _integer(owner, "key_layers[]", layer, 0, 1 << 12)
        if list(self.key_layers) != sorted(set(self.key_layers)):
            raise ValueError(f"{owner}: key_layers must be strictly increasing, got {list(self.key_layers)}")

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
    prompt_sha256: str = ""  # prompt_digest(prompt): the generation side imports it only for this prompt
    agent_metadata: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        owner = "context_phase_params"
        if not isinstance(self.prompt_sha256, str) or len(self.prompt_sha256) not in (0, 64):
            raise ValueError(f"{owner}: prompt_sha256 must be a SHA-256 hex digest")
        for name in ("request_key", "agent_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value) <= 1024:
                raise ValueError(f"{owner}: {name} must be a non-empty string of at most 1024 characters")
        if not isinstance(self.layout, RegionLayout):
            raise ValueError(f"{owner}: layout must be a RegionLayout")
        _integer(owner, "region_addr", self.region_addr, 0, (1 << 64) - 1)
        _integer(owner, "first_token", self.first_token, 0, (1 << 31) - 1)
        _integer(owner, "seed", self.seed, -(1 << 63), (1 << 63) - 1)
        for name in ("queue_s", "prefill_s", "hold_deadline_s"):
            _seconds(owner, name, getattr(self, name))
        if not isinstance(self.agent_metadata, bytes) or len(self.agent_metadata) > MAX_METADATA_BYTES:
            raise ValueError(f"{owner}: agent_metadata must be at most {MAX_METADATA_BYTES} bytes")

    def to_bytes(self, key: bytes) -> bytes:
        """The signed wire form (see the module docstring); ``key``: the deployment's internal key."""
        header = asdict(self)
        header.pop("agent_metadata")
        header["layout"]["key_layers"] = list(self.layout.key_layers)
        text = json.dumps(header).encode()
        body = MAGIC + struct.pack("<I", len(text)) + text + self.agent_metadata
        return body + hmac.new(key, body, hashlib.sha256).digest()

    def to_numpy(self, key: bytes) -> np.ndarray:
        """``UINT8`` tensor ``[1, N]`` for Triton (signed with ``key``)."""
        return np.frombuffer(self.to_bytes(key), dtype=np.uint8).reshape(1, -1).copy()

    @classmethod
    def from_bytes(cls, data: bytes | np.ndarray, key: bytes) -> ContextPhaseParams:
        """Check the tag with ``key``, then parse and check every field; ValueError naming the problem otherwise."""
        raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        if len(raw) < 8 + TAG_BYTES or raw[:4] != MAGIC:
            raise ValueError("context_phase_params: not a DHiSparse context phase (bad magic or too short)")
        body, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
        if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
            raise ValueError("context_phase_params: not signed by this deployment's context role (bad tag): only "
                             "the context model's own output is accepted")
        (size,) = struct.unpack("<I", body[4:8])
        if size > MAX_HEADER_BYTES or len(body) < 8 + size:
            raise ValueError("context_phase_params: truncated or oversized header")
        try:
            header = json.loads(body[8 : 8 + size])
            if not isinstance(header, dict) or not isinstance(header.get("layout"), dict):
                raise ValueError("the header is not an object with a layout")
            layout = dict(header.pop("layout"))
            if not isinstance(layout.get("key_layers"), list):
                raise ValueError("layout.key_layers must be a list")
            layout["key_layers"] = tuple(layout["key_layers"])
            _known(layout, RegionLayout)
            _known(header, cls)
            return cls(layout=RegionLayout(**layout), agent_metadata=body[8 + size :], **header)
        except (KeyError, TypeError, ValueError, RecursionError) as error:
            raise ValueError(f"context_phase_params: malformed header ({error})") from error


def prompt_digest(prompt: list[int]) -> str:
    """SHA-256 of a prompt's token ids (int64 little endian): what binds a context phase to its prompt."""
    return hashlib.sha256(np.asarray(prompt, dtype="<i8").tobytes()).hexdigest()


def _known(values: dict, kind: type) -> None:
    """Refuse fields ``kind`` does not have (their names would otherwise surface as a TypeError)."""
    names = {f.name for f in fields(kind)} - {"layout", "agent_metadata"}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
