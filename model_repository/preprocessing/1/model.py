"""Triton `preprocessing`: prompt text and stop/bad words -> token ids (see dhisparse.serving.text_processing)."""

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
        self.tokenizer = tokenization.load_tokenizer(parameters["tokenizer_dir"])
        self.add_special_tokens = parameters.get("add_special_tokens", "true").lower() == "true"
        self.limits = ServerSettings.from_parameters(parameters).limits  # checked before anything is tokenised

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                inputs = self.tensors.request_arrays(pb_utils, request, self.text.PREPROCESSING_INPUTS)
                outputs = self.text.preprocess(self.tokenizer, inputs, self.add_special_tokens, self.limits)
                responses.append(self.tensors.response(pb_utils, outputs))
            except Exception as error:  # bad input or anything else: an error response, never silence
                responses.append(self.tensors.error_response(pb_utils, error))
        return responses
