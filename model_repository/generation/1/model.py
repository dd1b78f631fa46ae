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
        from dhisparse.serving import ucx_binding
        from dhisparse.disagg.decode import load_decode_engine
        from dhisparse.disagg.nixl_transfer import NixlImporter
        from dhisparse.disagg.params import ContextPhaseParams
        from dhisparse.disagg.triton_context import GENERATION_ONLY, request_type
        from dhisparse.disagg.triton_generation import GenerationService
        from dhisparse.serving import internal_auth, llm_request, repository, triton_tensors
        from dhisparse.serving.engine_metrics import EngineMetrics
        from dhisparse.serving.server_settings import ServerSettings

        self.requests, self.tensors, self.params = llm_request, triton_tensors, ContextPhaseParams
        self.request_type, self.generation_only, self.auth = request_type, GENERATION_ONLY, internal_auth
        self.settings = ServerSettings.from_parameters(parameters)  # limits, the key of the trust boundary, drain
        if self.settings.auth is None:
            raise ValueError("the generation model needs the deployment's internal key (auth_key_file)")
        self.key = internal_auth.read_key_file(parameters["auth_key_file"])  # checks context_phase_params' tags
        self.names = (*llm_request.CONTROLLED_INPUTS, "request_type", "context_phase_params")  # + cancel, auth
        overrides = {key.removeprefix("engine."): repository.parse_override(value)
                     for key, value in parameters.items() if key.startswith("engine.")}
        ucx_binding.apply(parameters.get("nixl.ucx_net_devices", ""))  # before the agent exists
        importer = NixlImporter(parameters.get("nixl.agent_name", "dhisparse-generation"),
                                float(parameters.get("nixl.transfer_timeout_s", "30")))
        engine = load_decode_engine(parameters["engine_dir"], importer, **overrides)
        metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        interval_s = float(parameters.get("metrics_interval_ms", "250")) / 1000.0
        self.name = args["model_name"]
        self.service = GenerationService(pb_utils, engine, metrics, interval_s, on_engine_dead=self._engine_dead,
                                         drain=self.settings.drain)

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
                    self.settings.check_cancel(inputs, target, "generation")
                    self.service.cancel_client(target)
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                # Only the orchestrator may start a generation phase (it makes this process READ remote memory).
                self.settings.check(inputs, self.auth.GENERATION,
                                    self.auth.request_subject(request.request_id(), inputs),
                                    "generation is internal to the disaggregated deployment: only its orchestrator "
                                    "(disaggregated_serving_bls) may call it")
                kind = self.request_type(inputs, self.generation_only)
                if kind != self.generation_only:
                    raise ValueError(f"request_type must be {self.generation_only!r} for the generation model, "
                                     f"got {kind!r}")
                if "context_phase_params" not in inputs:
                    raise ValueError("context_phase_params is missing: send the context phase's output")
                context = self.params.from_bytes(inputs["context_phase_params"], self.key)
                request_limits = self.settings.limits
                self.service.start(self.requests.parse_llm_request(inputs, request_limits), context, sender,
                                   request.request_id())
            except Exception as error:  # bad input, refused params, a stopped engine: an error, never silence
                sender.send(self.tensors.error_response(pb_utils, error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self.service.close()
