"""Triton `generation` model (disaggregated serving, decode phase): imports each request's history over NIXL.

Thin on purpose: everything lives in `dhisparse.disagg` (decode.py, nixl_transfer.py, triton_generation.py).
"""

from __future__ import annotations

import json
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        if parameters.get("python_path"):  # the launcher pins the dhisparse package it was started from
            sys.path.insert(0, parameters["python_path"])
        from dhisparse.disagg.decode import load_decode_engine
        from dhisparse.disagg.nixl_transfer import NixlImporter
        from dhisparse.disagg.params import ContextPhaseParams
        from dhisparse.disagg.triton_context import GENERATION_ONLY, request_type
        from dhisparse.disagg.triton_generation import GenerationService
        from dhisparse.serving import llm_request, repository, triton_tensors
        from dhisparse.serving.engine_metrics import EngineMetrics

        self.requests, self.tensors, self.params = llm_request, triton_tensors, ContextPhaseParams
        self.request_type, self.generation_only = request_type, GENERATION_ONLY
        self.names = (*llm_request.LLM_INPUTS, "request_type", "context_phase_params")  # LLM_INPUTS: + cancel
        overrides = {key.removeprefix("engine."): repository.parse_override(value)
                     for key, value in parameters.items() if key.startswith("engine.")}
        importer = NixlImporter(parameters.get("nixl.agent_name", "dhisparse-generation"),
                                float(parameters.get("nixl.transfer_timeout_s", "30")))
        engine = load_decode_engine(parameters["engine_dir"], importer, **overrides)
        metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        interval_s = float(parameters.get("metrics_interval_ms", "250")) / 1000.0
        self.name = args["model_name"]
        self.service = GenerationService(pb_utils, engine, metrics, interval_s, on_engine_dead=self._engine_dead)

    def _engine_dead(self, reason: str) -> None:
        """The engine stopped (every client has its error): unload this model so its readiness turns false, like
        the co-located `dhisparse` model."""
        self.tensors.unload_in_background(pb_utils, self.name, reason)

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = self.tensors.request_arrays(pb_utils, request, self.names)
                target = self.requests.cancel_target(inputs)
                if target is not None:  # control request from disaggregated_serving_bls
                    self.service.cancel_client(target)
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                kind = self.request_type(inputs, self.generation_only)
                if kind != self.generation_only:
                    raise ValueError(f"request_type must be {self.generation_only!r} for the generation model, "
                                     f"got {kind!r}")
                if "context_phase_params" not in inputs:
                    raise ValueError("context_phase_params is missing: send the context phase's output")
                context = self.params.from_bytes(inputs["context_phase_params"])
                self.service.start(self.requests.parse_llm_request(inputs), context, sender, request.request_id())
            except Exception as error:  # InvalidRequestError, malformed params, a stopped engine: an error, never silence
                sender.send(self.tensors.error_response(pb_utils, error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self.service.close()
