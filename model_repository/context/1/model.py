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
        from dhisparse.serving import ucx_binding
        from dhisparse.disagg.nixl_transfer import NixlExporter
        from dhisparse.disagg.prefill import PrefillEngine, PrefillService
        from dhisparse.disagg.triton_context import ContextService
        from dhisparse.serving import internal_auth, llm_request, repository, triton_tensors
        from dhisparse.serving.engine_metrics import EngineMetrics
        from dhisparse.serving.server_settings import ServerSettings

        self.tensors, self.requests, self.auth = triton_tensors, llm_request, internal_auth
        self.settings = ServerSettings.from_parameters(parameters)  # limits, the key of the trust boundary, drain
        if self.settings.auth is None:
            raise ValueError("the context model needs the deployment's internal key (auth_key_file)")
        self.names = (*llm_request.CONTROLLED_INPUTS, "request_type")  # + cancel_request_id, dhisparse_auth
        overrides = {key.removeprefix("engine."): repository.parse_override(value)
                     for key, value in parameters.items() if key.startswith("engine.")}
        ucx_binding.apply(parameters.get("nixl.ucx_net_devices", ""))  # before the agent exists
        exporter = NixlExporter(parameters.get("nixl.agent_name", "dhisparse-context"),
                                float(parameters.get("nixl.hold_timeout_s", "60")),
                                arena_limit_bytes=int(parameters.get("nixl.arena_limit_bytes", str(1 << 30))))
        metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        interval_s = float(parameters.get("metrics_interval_ms", "250")) / 1000.0
        self.service = ContextService(PrefillService(PrefillEngine(parameters["engine_dir"], **overrides), exporter),
                                      metrics=metrics, metrics_interval_s=interval_s,
                                      key=internal_auth.read_key_file(parameters["auth_key_file"]),
                                      limits=self.settings.limits)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                inputs = self.tensors.request_arrays(pb_utils, request, self.names)
                target = self.requests.cancel_target(inputs)
                if target is not None:  # control request from disaggregated_serving_bls: free that region now
                    self.settings.check_cancel(inputs, target, "context")
                    freed = self.service.cancel(target)
                    responses.append(self.tensors.response(pb_utils, self.service.cancel_answer(freed)))
                    continue
                # Only the orchestrator may run a context phase (its output opens a READ of this process's memory).
                self.settings.check(inputs, self.auth.CONTEXT, self.auth.request_subject(request.request_id(), inputs),
                                    "context is internal to the disaggregated deployment: only its orchestrator "
                                    "(disaggregated_serving_bls) may call it")
                self.settings.drain.refuse_new_requests()
                responses.append(self.tensors.response(pb_utils, self.service.run(inputs, request.request_id())))
            except Exception as error:  # InvalidRequestError, refusals, a failed prefill: an error, never silence
                responses.append(self.tensors.error_response(pb_utils, error))
        return responses

    def finalize(self) -> None:
        self.service.close()
