"""Triton `dhisparse` model: hands each request to the engine's background loop and streams its tokens back.

Thin on purpose: tensors -> `parse_llm_request` -> `LLMService.start`; everything else lives in
`dhisparse.serving` (llm_request.py, llm_service.py, engine_metrics.py).
"""

from __future__ import annotations

import faulthandler
import json
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable(all_threads=True)  # a crash of this stub leaves every thread's Python stack in the log
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        if parameters.get("python_path"):  # the launcher pins the dhisparse package it was started from
            sys.path.insert(0, parameters["python_path"])
        from dhisparse import LLM
        from dhisparse.engine.loop import EngineLoop
        from dhisparse.serving import llm_request, repository, tokenization, triton_tensors
        from dhisparse.serving.engine_metrics import EngineMetrics
        from dhisparse.serving.llm_service import LLMService
        from dhisparse.serving.server_settings import ServerSettings

        self.requests, self.tensors = llm_request, triton_tensors
        self.settings = ServerSettings.from_parameters(parameters)  # limits, internal key, drain
        overrides = {key.removeprefix("engine."): repository.parse_override(value)
                     for key, value in parameters.items() if key.startswith("engine.")}
        llm = LLM(parameters["engine_dir"], **overrides)
        workspace = llm.engine.workspace
        print(f"dhisparse: {workspace.describe() if workspace is not None else 'no workspace bound (deepseek_v4)'}; "
              f"KV pool {llm.engine.cfg.pool_bytes} bytes", flush=True)
        metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        interval_s = float(parameters.get("metrics_interval_ms", "250")) / 1000.0
        self.name = args["model_name"]
        token_bytes = tokenization.engine_token_bytes(parameters["engine_dir"])  # None without tokenizer.json
        self.service = LLMService(pb_utils, EngineLoop(llm), metrics, interval_s, on_engine_dead=self._engine_dead,
                                  drain=self.settings.drain, token_bytes=token_bytes)
        self.exclude_input_default = parameters.get("exclude_input_in_output", "true").lower() == "true"

    def _engine_dead(self, reason: str) -> None:
        """The engine stopped (every client has its error): unload this model so its readiness turns false."""
        self.tensors.unload_in_background(pb_utils, self.name, reason)

    def execute(self, requests: list) -> None:
        for request in requests:
            with self.tensors.STUB_LOCK:  # numpy and Triton objects: one thread at a time (triton_tensors.STUB_LOCK)
                self._execute_one(request)
        # Decoupled: responses go through each request's sender, execute returns nothing.

    def _execute_one(self, request) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            inputs = self.tensors.request_arrays(pb_utils, request, self.requests.CONTROLLED_INPUTS)
            target = self.requests.cancel_target(inputs)
            if target is not None:  # control request of dhisparse_bls, signed with the internal key
                self.settings.check_cancel(inputs, target, self.name)
                self.service.cancel_client(target)
                self.tensors.send(pb_utils, sender, None, final)
                return
            if self.requests.stop_requested(inputs):  # tensorrtllm's stop: off unless the deployment allows it
                self.settings.check_stop(self.name)
                self.service.cancel_client(request.request_id())
                self.tensors.send(pb_utils, sender, None, final)
                return
            parsed = self.requests.parse_llm_requests(inputs, self.exclude_input_default, self.settings.limits)
            self.service.start_all(parsed, sender, request.request_id())
        except Exception as error:  # bad input (ValueError), a stopped engine, anything: an error, never silence
            self.tensors.send(pb_utils, sender, error, final)

    def finalize(self) -> None:
        self.service.close()
