"""Triton `context` model (disaggregated serving, prefill phase): tensors in, first token + context_phase_params out.

Thin on purpose: everything lives in `dhisparse.disagg` (prefill.py, nixl_transfer.py, triton_context.py).
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
        from dhisparse.disagg.nixl_transfer import NixlExporter
        from dhisparse.disagg.prefill import PrefillEngine, PrefillService
        from dhisparse.disagg.triton_context import ContextService
        from dhisparse.serving import llm_request, repository, triton_tensors
        from dhisparse.serving.engine_metrics import EngineMetrics

        self.tensors, self.requests = triton_tensors, llm_request
        self.names = (*llm_request.LLM_INPUTS, "request_type")  # LLM_INPUTS: + cancel_request_id
        overrides = {key.removeprefix("engine."): repository.parse_override(value)
                     for key, value in parameters.items() if key.startswith("engine.")}
        exporter = NixlExporter(parameters.get("nixl.agent_name", "dhisparse-context"),
                                float(parameters.get("nixl.hold_timeout_s", "60")))
        metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        interval_s = float(parameters.get("metrics_interval_ms", "250")) / 1000.0
        self.service = ContextService(PrefillService(PrefillEngine(parameters["engine_dir"], **overrides), exporter),
                                      metrics=metrics, metrics_interval_s=interval_s)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                inputs = self.tensors.request_arrays(pb_utils, request, self.names)
                target = self.requests.cancel_target(inputs)
                if target is not None:  # control request from disaggregated_serving_bls: free that region now
                    freed = self.service.cancel(target)
                    responses.append(self.tensors.response(pb_utils, self.service.cancel_answer(freed)))
                    continue
                responses.append(self.tensors.response(pb_utils, self.service.run(inputs, request.request_id())))
            except ValueError as error:  # InvalidRequestError and SamplingParams' checks
                responses.append(self.tensors.error_response(pb_utils, error))
        return responses

    def finalize(self) -> None:
        self.service.close()
