"""The `generation` model's service on a dead engine: clients get the error, the model is told to unload itself.

A real decode engine imports a real prompt over NIXL (both agents in this process) and then hits the injected
``break_invariants`` fault, after which its invariants cannot be restored. The Triton side is a recording
stand-in for ``triton_python_backend_utils`` (responses and senders only); the same model runs through the real
server in tests/serving/test_disaggregated.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from tiny_models import random_prompts

from dhisparse import SamplingParams

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse.disagg.decode import load_decode_engine
from dhisparse.disagg.nixl_transfer import NixlExporter, NixlImporter
from dhisparse.disagg.prefill import PrefillEngine, PrefillService
from dhisparse.disagg.triton_generation import GenerationService
from dhisparse.errors import EngineDeadError
from dhisparse.serving.llm_request import parse_llm_request

PROMPT = random_prompts([21], 96, seed=5)[0]


class RecordingPb:
    """What GenerationService uses of triton_python_backend_utils: responses, errors, the final flag."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError:
        CANCELLED = 1

        def __init__(self, message: str, code: int = 0) -> None:
            self.message = message

    @dataclass
    class Tensor:
        name: str
        value: np.ndarray

    @dataclass
    class InferenceResponse:
        output_tensors: list
        error: Any = None


@dataclass
class RecordingSender:
    responses: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.responses.append(response)
        if flags:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


def test_dead_generation_engine_fails_its_requests_and_asks_to_unload(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    service = PrefillService(PrefillEngine(engine_dir), NixlExporter("fault-context", hold_timeout_s=60.0))
    importer = NixlImporter("fault-decode", timeout_s=10.0)
    engine = load_decode_engine(engine_dir, importer, kv_policy="adaptive", page_rows=4, pool_bytes=1 << 24,
                                fault_injection="break_invariants@2")
    dead: list[str] = []
    generation = GenerationService(RecordingPb, engine, None, interval_s=0.02, on_engine_dead=dead.append)
    try:
        arrays = {"input_ids": np.array([PROMPT], dtype=np.int32),
                  "input_lengths": np.array([[len(PROMPT)]], dtype=np.int32),
                  "request_output_len": np.array([[8]], dtype=np.int32), "streaming": np.array([[True]])}
        request = parse_llm_request(arrays)
        context = service.run(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), "victim")
        sender = RecordingSender()
        generation.start(request, context, sender, "victim")
        assert sender.done.wait(60), "the request never ended"
        final = sender.responses[-1]
        assert final is not None and final.error is not None and "break_invariants" in final.error.message
        for _ in range(500):  # the engine thread reports the dead engine right after the failed step
            if dead:
                break
            time.sleep(0.01)
        assert len(dead) == 1 and "the engine stopped" in dead[0] and generation.dead == dead[0]
        with pytest.raises(EngineDeadError):  # new requests are refused with the reason, nothing queued
            generation.start(request, context, RecordingSender(), "late")
    finally:
        generation.close()
        service.close()
