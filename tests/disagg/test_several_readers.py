"""Several readers of one region (the tensor-parallel ranks of a generation engine): the context side frees a
region only when every reader's READ notified it; a plain key (one reader, or a release) frees it at once.

Real NIXL agents (UCX, loopback) in this process: a context service publishes a prompt's history and two importers,
reader 0 and reader 1 of 2, READ the whole region; both get the published bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_prompts

from dhisparse import SamplingParams

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse.disagg.nixl_transfer import (
    NixlExporter,
    NixlImporter,
    parse_notification,
    reader_mark,
)
from dhisparse.disagg.prefill import PrefillEngine, PrefillService

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def test_notifications_name_their_reader() -> None:
    assert parse_notification("ctx/0/r1") == ("ctx/0/r1", 0, 1)
    assert parse_notification("ctx/0/r1" + reader_mark(1, 2)) == ("ctx/0/r1", 1, 2)
    assert parse_notification("ctx/0/r1" + reader_mark(0, 4)) == ("ctx/0/r1", 0, 4)
    assert parse_notification("ctx/0/r1\x1freader=2/2") == ("ctx/0/r1\x1freader=2/2", 0, 1)  # not a reader of 2
    with pytest.raises(ValueError, match="reader"):
        NixlImporter("bad-reader", reader=2, readers=2)


def _poll_until(exporter: NixlExporter, name: str, value: float) -> dict[str, float]:
    for _ in range(5000):  # the notification arrives with the READ's completion, asynchronously
        exporter.poll()
        if exporter.stats()[name] == value:
            break
    return exporter.stats()


def _read_all(importer: NixlImporter, context) -> torch.Tensor:
    total = context.layout.total_bytes
    buffer = importer.buffer(total)
    importer.read(context, [], [buffer], np.array([buffer.data_ptr()]), np.array([0]), np.array([total]))
    return buffer


def test_a_region_is_freed_when_every_reader_read_it(tiny_engine) -> None:
    service = PrefillService(PrefillEngine(tiny_engine("glm_fsfs_sparse", "float32")),
                             NixlExporter("readers-ctx", hold_timeout_s=600.0))
    readers = [NixlImporter(f"readers-dec{i}", timeout_s=10.0, reader=i, readers=2) for i in range(2)]
    exporter = service.exporter
    try:
        prompt = random_prompts([19], 96, seed=3)[0]
        context = service.run(prompt, PARAMS, "shared")
        key = context.request_key
        published = _read_all(readers[0], context).clone()
        assert published.any()
        stats = _poll_until(exporter, "regions_partly_read", 1.0)
        assert stats["regions_partly_read"] == 1 and key in exporter.held_keys  # one of two readers done: held
        assert torch.equal(_read_all(readers[1], context), published)  # the second reader gets the same bytes
        stats = _poll_until(exporter, "regions_held", 0.0)
        assert stats["regions_held"] == 0 and stats["regions_partly_read"] == 0 and stats["regions_released"] == 1

        other = service.run(prompt, PARAMS, "released")  # a plain key (a release) frees it whatever the readers
        _read_all(readers[0], other)
        _poll_until(exporter, "regions_partly_read", 1.0)
        readers[1].release_remote(other)
        stats = _poll_until(exporter, "regions_held", 0.0)
        assert stats["regions_held"] == 0 and stats["regions_released"] == 2 and stats["regions_expired"] == 0
    finally:
        for reader in readers:
            reader.close()
        service.close()
