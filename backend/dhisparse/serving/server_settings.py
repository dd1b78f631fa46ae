"""What every Python model reads from its server parameters (`repository.server_parameters` writes them).

One object per model: the per-request limits, the internal key (`InternalAuth`, None when the repository has no
key: then every request that needs a token is refused), the drain watch, and whether tensorrtllm's ``stop`` input is
honoured. Model files build it with ``ServerSettings.from_parameters(parameters)`` in ``initialize``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dhisparse.errors import InvalidRequestError
from dhisparse.serving.drain import DrainWatch
from dhisparse.serving.internal_auth import CANCEL, KEY_FILE_PARAMETER, InternalAuth, UnauthorizedError
from dhisparse.serving.limits import RequestLimits


@dataclass
class ServerSettings:
    limits: RequestLimits
    auth: InternalAuth | None
    drain: DrainWatch
    allow_stop_by_request_id: bool = False

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> ServerSettings:
        key_file = parameters.get(KEY_FILE_PARAMETER, "")
        auth = InternalAuth.from_key_file(key_file) if key_file else None
        return cls(RequestLimits.from_parameters(parameters), auth, DrainWatch.from_parameters(parameters),
                   parameters.get("allow_stop_by_request_id", "false").lower() == "true")

    def check(self, inputs: Mapping[str, np.ndarray], purpose: str, subject: str, refusal: str) -> None:
        """Accept a token-carrying request (see `InternalAuth.check`); refuse everything without a key."""
        if self.auth is None:
            raise UnauthorizedError(f"{refusal} (this model has no internal key)")
        self.auth.check(inputs, purpose, subject, refusal)

    def check_cancel(self, inputs: Mapping[str, np.ndarray], target: str, model: str) -> None:
        """A ``cancel_request_id`` control request: only the deployment's own BLS models may send one."""
        self.check(inputs, CANCEL, target, f"{model}: cancel_request_id is a control input of the server's own "
                   "models; cancel your own request by cancelling its stream")

    def check_stop(self, model: str) -> None:
        """tensorrtllm's ``stop`` input: honoured only when the deployment allows it (any client could name any id)."""
        if not self.allow_stop_by_request_id:
            raise InvalidRequestError(f"{model}: stop by request id is disabled (request ids are chosen by clients, "
                                      "so one client could stop another's request); cancel your own request by "
                                      "cancelling its stream, or start dhisparse-serve with --allow-stop-by-request-id "
                                      "where every client is trusted")
