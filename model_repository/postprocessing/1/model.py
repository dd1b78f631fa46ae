"""Triton `postprocessing`: generated token ids -> UTF-8 text bytes (see dhisparse.serving.text_processing)."""

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
        from dhisparse.serving import text_processing, tokenization, triton_tensors
        from dhisparse.serving.server_settings import ServerSettings

        self.text, self.tensors = text_processing, triton_tensors
        self.limits = ServerSettings.from_parameters(parameters).limits
        skip = parameters.get("skip_special_tokens", "true").lower() == "true"
        self.token_bytes = tokenization.TokenBytes(tokenization.load_tokenizer(parameters["tokenizer_dir"]), skip)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                inputs = self.tensors.request_arrays(pb_utils, request, self.text.POSTPROCESSING_INPUTS)
                self.limits.check_request_bytes(inputs)  # a client may call postprocessing directly
                responses.append(self.tensors.response(pb_utils, self.text.postprocess(self.token_bytes, inputs)))
            except Exception as error:  # bad input or anything else: an error response, never silence
                responses.append(self.tensors.error_response(pb_utils, error))
        return responses
