"""Triton `dhisparse_bls`: the ensemble's interface with cancellation and whole-character streaming.

Thin on purpose: each request is handed to `dhisparse.serving.bls.BLSService`, which tokenises, calls the
`dhisparse` model and streams text back from its own thread.
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
        from dhisparse.serving import tokenization
        from dhisparse.serving.bls import BLSService
        from dhisparse.serving.server_settings import ServerSettings

        tokenizer = tokenization.load_tokenizer(parameters["tokenizer_dir"])
        skip = parameters.get("skip_special_tokens", "true").lower() == "true"
        add = parameters.get("add_special_tokens", "true").lower() == "true"
        settings = ServerSettings.from_parameters(parameters)  # limits, the key that signs its cancel requests
        self.service = BLSService(pb_utils, tokenizer, tokenization.TokenBytes(tokenizer, skip),
                                  add_special_tokens=add, limits=settings.limits, auth=settings.auth)

    def execute(self, requests: list) -> None:
        for request in requests:
            self.service.start(request)
