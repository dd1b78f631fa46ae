"""Triton `disaggregated_serving_bls`: context phase, then generation phase (dhisparse.disagg.triton_bls).

Thin on purpose: each request is handed to `DisaggregatedBLS`, which calls `context` (in this server, or on the
server named by the ``context_url`` parameter) and `generation` from its own thread and streams the tokens back.
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
        from dhisparse.disagg.context_client import LocalContext, RemoteContext
        from dhisparse.disagg.triton_bls import DisaggregatedBLS
        from dhisparse.serving.server_settings import ServerSettings

        settings = ServerSettings.from_parameters(parameters)  # its key signs every request to context / generation
        # context_url (HOST:PORT, gRPC): `context` runs on another server (dhisparse-serve --role context)
        url = parameters.get("context_url", "")
        context = RemoteContext(url, auth=settings.auth) if url else LocalContext(pb_utils, auth=settings.auth)
        self.service = DisaggregatedBLS(pb_utils, context, auth=settings.auth, limits=settings.limits)

    def execute(self, requests: list) -> None:
        for request in requests:
            self.service.start(request)
