"""Requests only our own models may send: a shared secret and an HMAC token on each such request.

Some model inputs are controls, not client features: ``cancel_request_id`` (the BLS models stop a request they
started) and, in a disaggregated deployment, every request to `context` and `generation` (sent by the orchestrator
``disaggregated_serving_bls``). Triton has no per-model access control, so those requests carry one more input,
``dhisparse_auth`` (BYTES ``[1, 1]``): ``"<unix time>:<hex HMAC-SHA256>"`` over the purpose, a subject (the
request id, and for the engine models a digest of the prompt) and the time, keyed by a 32-byte secret that the
models of one deployment share through a key file (mode 0600, never a model parameter: parameters are readable
over the model-config API). A token is accepted once, within ``max_age_s`` of its time (clocks of two hosts must
agree that closely). Clients never see a token: the BLS calls stay inside the server, and between two hosts the
orchestrator's gRPC call to the context server carries it (run that link on a private network or with TLS).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dhisparse.errors import InvalidRequestError

AUTH_INPUT = "dhisparse_auth"
KEY_FILE_PARAMETER = "auth_key_file"
KEY_BYTES = 32
CANCEL, CONTEXT, GENERATION = "cancel", "context", "generation"


class UnauthorizedError(InvalidRequestError):
    """A request that only the deployment's own models may send came without a valid token."""


def write_key_file(path: Path) -> Path:
    """Write a fresh random key to ``path`` (hex, mode 0600, replacing any old one atomically); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_hex(KEY_BYTES) + "\n")
    os.replace(temporary, path)
    return path


def read_key_file(path: str | Path) -> bytes:
    """The key in ``path``; ValueError when the file is missing, malformed or readable by group or others."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as error:
        raise ValueError(f"cannot read the key file {path}: {error}") from error
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"the key file {path} is accessible to group or others (mode {oct(mode & 0o777)}); "
                         f"chmod 600 {path}")
    try:
        key = bytes.fromhex(text)
    except ValueError as error:
        raise ValueError(f"the key file {path} must hold {KEY_BYTES} bytes as hex") from error
    if len(key) < 16:
        raise ValueError(f"the key in {path} is {len(key)} bytes; at least 16 are needed")
    return key


def prompt_digest(inputs: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of a request's ``input_ids`` and ``input_lengths`` (dtype-independent), for binding a token to it."""
    digest = hashlib.sha256()
    for name in ("input_ids", "input_lengths"):
        if name in inputs:
            digest.update(np.ascontiguousarray(np.asarray(inputs[name]).astype("<i8")).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def request_subject(request_id: str, inputs: Mapping[str, np.ndarray]) -> str:
    """The subject an engine-model token is bound to: the Triton request id and the prompt's digest."""
    return f"{request_id}|{prompt_digest(inputs)}"


class InternalAuth:
    """Make and check ``dhisparse_auth`` tokens with one deployment key (see the module docstring)."""

    def __init__(self, key: bytes, max_age_s: float = 300.0) -> None:
        if len(key) < 16:
            raise ValueError("the internal key must be at least 16 bytes")
        self._key, self.max_age_s = key, max_age_s
        self._seen: dict[bytes, float] = {}  # accepted tokens -> when they expire (each is accepted once)
        self._lock = threading.Lock()

    @classmethod
    def from_key_file(cls, path: str | Path) -> InternalAuth:
        return cls(read_key_file(path))

    def _mac(self, purpose: str, subject: str, stamp: str) -> str:
        message = f"{purpose}\n{subject}\n{stamp}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def token(self, purpose: str, subject: str, now: float | None = None) -> np.ndarray:
        """The ``dhisparse_auth`` input (BYTES ``[1, 1]``) for a request of ``purpose`` about ``subject``."""
        stamp = f"{time.time() if now is None else now:.6f}"
        return np.array([[f"{stamp}:{self._mac(purpose, subject, stamp)}".encode()]], dtype=object)

    def check(self, inputs: Mapping[str, np.ndarray], purpose: str, subject: str, refusal: str) -> None:
        """Accept the request's token for ``purpose``/``subject`` or raise UnauthorizedError(``refusal``)."""
        raw = inputs.get(AUTH_INPUT)
        value = np.asarray(raw).reshape(-1) if raw is not None else np.empty(0)
        token = value[0] if value.size == 1 else b""
        token = token if isinstance(token, bytes) else str(token).encode()
        stamp, _, mac = token.decode(errors="replace").partition(":")
        try:
            age = abs(time.time() - float(stamp))
        except ValueError:
            age = float("inf")
        if not (age <= self.max_age_s and hmac.compare_digest(mac.encode(), self._mac(purpose, subject,
                                                                                       stamp).encode())):
            raise UnauthorizedError(f"{refusal} (no valid {AUTH_INPUT})")
        now = time.monotonic()
        with self._lock:
            for seen in [t for t, expiry in self._seen.items() if expiry < now]:
                del self._seen[seen]
            if token in self._seen:
                raise UnauthorizedError(f"{refusal} ({AUTH_INPUT} was already used)")
            self._seen[token] = now + 2 * self.max_age_s
