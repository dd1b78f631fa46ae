"""ContextPhaseParams: the wire format round-trips, malformed bytes are refused by name, and the region layout packs
rows, indexer keys and drafter features at aligned, non-overlapping offsets that unpack to the same values."""

from __future__ import annotations

import pytest
import torch

from dhisparse.disagg.params import ALIGN, ContextPhaseParams, RegionLayout


def _layout(dtype: str = "float32", features: bool = True) -> RegionLayout:
    return RegionLayout(num_sources=3, prompt_len=11, row_dim=7, rows_dtype=dtype, key_layers=(0, 2),
                        index_key_dim=5, feature_rows=4 if features else 0, feature_dim=6 if features else 0)


def test_params_round_trip_through_bytes_and_numpy() -> None:
    params = ContextPhaseParams("ctx/0/r1", "ctx", 1 << 33, _layout(), first_token=17, seed=-5, queue_s=0.25,
                                prefill_s=1.5, hold_deadline_s=60.0, agent_metadata=b"\x00\x01meta")
    assert ContextPhaseParams.from_bytes(params.to_bytes()) == params
    array = params.to_numpy()
    assert array.dtype.name == "uint8" and array.shape[0] == 1
    assert ContextPhaseParams.from_bytes(array) == params
    assert ContextPhaseParams.from_bytes(array).agent_metadata == b"\x00\x01meta"


@pytest.mark.parametrize("data", [b"", b"XXXX\x00\x00\x00\x00", b"DHCP\xff\x00\x00\x00{}", b"DHCP\x02\x00\x00\x00{}"])
def test_malformed_params_are_refused_by_name(data: bytes) -> None:
    with pytest.raises(ValueError, match="context_phase_params"):
        ContextPhaseParams.from_bytes(data)


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
