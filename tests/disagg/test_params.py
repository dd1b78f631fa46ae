"""ContextPhaseParams: the wire format round-trips, only params signed with the deployment's key are accepted,
malformed bytes are refused by name (a fuzz test over random bytes and over signed random headers: every input is a
ValueError or valid params, never another exception), and the region layout packs rows, indexer keys and drafter
features at aligned, non-overlapping offsets that unpack to the same values."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.disagg.params import ALIGN, MAGIC, ContextPhaseParams, RegionLayout

KEY = bytes(range(32))


def _layout(dtype: str = "float32", features: bool = True) -> RegionLayout:
    return RegionLayout(num_sources=3, prompt_len=11, row_dim=7, rows_dtype=dtype, key_layers=(0, 2),
                        index_key_dim=5, feature_rows=4 if features else 0, feature_dim=6 if features else 0)


def test_params_round_trip_through_bytes_and_numpy() -> None:
    params = ContextPhaseParams("ctx/0/r1", "ctx", 1 << 33, _layout(), first_token=17, seed=-5, queue_s=0.25,
                                prefill_s=1.5, hold_deadline_s=60.0, agent_metadata=b"\x00\x01meta")
    assert ContextPhaseParams.from_bytes(params.to_bytes(KEY), KEY) == params
    array = params.to_numpy(KEY)
    assert array.dtype.name == "uint8" and array.shape[0] == 1
    assert ContextPhaseParams.from_bytes(array, KEY) == params
    assert ContextPhaseParams.from_bytes(array, KEY).agent_metadata == b"\x00\x01meta"


def _params(**changes) -> ContextPhaseParams:
    fields = {"request_key": "ctx/0/r1", "agent_name": "ctx", "region_addr": 1 << 33, "layout": _layout(),
              "first_token": 17, "seed": -5, **changes}
    return ContextPhaseParams(**fields)


def test_params_of_another_key_or_altered_are_refused() -> None:
    data = bytearray(_params().to_bytes(KEY))
    with pytest.raises(ValueError, match="bad tag"):
        ContextPhaseParams.from_bytes(bytes(data), bytes(32))  # signed by someone else
    offset = bytes(data).index(b'"region_addr": ') + len(b'"region_addr": ')
    data[offset] = ord("9")  # point the READ elsewhere (another request's region)
    with pytest.raises(ValueError, match="bad tag"):
        ContextPhaseParams.from_bytes(bytes(data), KEY)


def _signed(header: object, metadata: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    body = MAGIC + struct.pack("<I", len(text)) + text + metadata
    return body + hmac.new(KEY, body, hashlib.sha256).digest()


@pytest.mark.parametrize("data", [b"", b"XXXX\x00\x00\x00\x00", b"DHC2\xff\x00\x00\x00{}", b"DHC2\x02\x00\x00\x00{}"])
def test_malformed_params_are_refused_by_name(data: bytes) -> None:
    with pytest.raises(ValueError, match="context_phase_params"):
        ContextPhaseParams.from_bytes(data, KEY)


@pytest.mark.parametrize("change", [
    {"rows_dtype": "int8"}, {"rows_dtype": 3}, {"num_sources": 0}, {"num_sources": True}, {"row_dim": -1},
    {"key_layers": [2, 0]}, {"key_layers": "x"}, {"prompt_len": 1 << 40}, {"feature_dim": 1.5}, {"extra": 1},
])
def test_signed_headers_with_bad_layouts_are_refused_by_name(change: dict) -> None:
    header = json.loads(_params().to_bytes(KEY)[8:-32].decode())
    header["layout"].update(change)
    with pytest.raises(ValueError, match="context_phase_params"):
        ContextPhaseParams.from_bytes(_signed(header), KEY)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="context_phase_params"):
        ContextPhaseParams.from_bytes(data, KEY)
    with pytest.raises(ValueError, match="context_phase_params"):
        ContextPhaseParams.from_bytes(MAGIC + data, KEY)


_json = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                   max_size=4), max_leaves=12)
_FIELDS = ["request_key", "agent_name", "region_addr", "layout", "first_token", "seed", "queue_s", "prefill_s",
           "hold_deadline_s", "prompt_sha256"]
_LAYOUT = ["num_sources", "prompt_len", "row_dim", "rows_dtype", "key_layers", "index_key_dim", "feature_rows",
           "feature_dim"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _json), st.dictionaries(st.sampled_from(_LAYOUT), _json),
       st.booleans(), st.binary(max_size=16))
def test_fuzz_signed_random_headers_parse_or_are_refused(header: dict, layout: dict, nest: bool, meta: bytes) -> None:
    """Even with a valid tag (an insider, or a bug on the context side) a header is valid params or a ValueError."""
    if nest:
        header = {**json.loads(_params().to_bytes(KEY)[8:-32].decode()), **header}
        header["layout"] = {**header["layout"], **layout} if isinstance(header["layout"], dict) else layout
    try:
        params = ContextPhaseParams.from_bytes(_signed(header, meta), KEY)
    except ValueError as error:
        assert "context_phase_params" in str(error)
    else:
        assert params.layout.total_bytes >= 0 and params.agent_metadata == meta


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("features", [True, False])
def test_region_packs_and_unpacks_every_part(dtype: str, features: bool) -> None:
    layout = _layout(dtype, features)
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 11, 7, generator=g).to(torch_dtype)
    keys = {0: torch.randn(11, 5, generator=g).to(torch_dtype), 2: torch.randn(11, 5, generator=g).to(torch_dtype)}
    feats = torch.randn(4, 6, generator=g) if features else None
    spans = [(0, layout.rows_bytes)] + [(layout.key_offset(k), layout.key_bytes) for k in (0, 2)]
    if features:
        spans.append((layout.features_offset, layout.features_bytes))
    for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
        assert b % ALIGN == 0 and a + n <= b  # aligned and non-overlapping
    end = spans[-1][0] + spans[-1][1]
    assert end <= layout.total_bytes < end + ALIGN  # at most the alignment padding after the last part
    region = torch.full((layout.total_bytes,), 255, dtype=torch.uint8)
    layout.pack(region, rows, keys, feats)
    assert torch.equal(layout.unpack_rows(region), rows)
    meta = region[layout.meta_offset :]  # what the decode side reads into its scratch buffer
    got = layout.unpack_keys(meta, layout.meta_offset)
    assert all(torch.equal(got[k], keys[k]) for k in (0, 2))
    unpacked = layout.unpack_features(meta, layout.meta_offset)
    assert (unpacked is None) == (not features)
    if features:
        assert torch.equal(unpacked, feats)
