"""tritonserver's access-control and TLS flags, as one validated set of options.

Defaults (what ``dhisparse-serve`` runs with unless told otherwise):

* The administrative APIs are restricted, over HTTP (``--http-restricted-api``) and gRPC
  (``--grpc-restricted-protocol``): ``model-repository`` (load / unload / index: a load with a file override runs
  arbitrary Python, an unload stops the engine), ``shared-memory`` (registering a region by name would reach the
  Python backend's own regions), ``trace`` and ``logging``. A request to them must carry the header
  ``dhisparse-admin-key: <key>``; the key is ``admin_key`` when given (``--admin-key-file``), otherwise a random
  one that is never shown, which turns those APIs off. Inference, health, metadata, model config and statistics
  stay open (clients and perf_analyzer need them).
* gRPC TLS (``--grpc-use-ssl`` / ``--grpc-use-ssl-mutual`` with server certificate, key and root certificate) when
  :class:`GrpcTls` is given. tritonserver has no TLS for HTTP: put HTTP behind a TLS-terminating reverse proxy, or
  turn it off (``allow_http=False``) and serve gRPC only (docs/security.md).

The restricted-API key travels on tritonserver's command line (the only way it takes one), so local users who can
list processes can read it; the network cannot.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

APIS = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics",
        "trace", "logging")
ADMIN_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_HEADER = "dhisparse-admin-key"
_RESTRICTION = re.compile(r"^([a-z-]+(?:,[a-z-]+)*):([a-z0-9_-]+)=(\S+)$")


def parse_restriction(text: str) -> tuple[tuple[str, ...], str, str]:
    """``"APIS:HEADER=VALUE"`` (APIS comma-separated) -> ``(apis, header, value)``; ValueError saying what is wrong."""
    match = _RESTRICTION.match(text)
    if not match:
        raise ValueError(f"a restriction is APIS:HEADER=VALUE (APIS comma-separated, HEADER lower case), got {text!r}")
    apis = tuple(match.group(1).split(","))
    unknown = [api for api in apis if api not in APIS]
    if unknown:
        raise ValueError(f"unknown API {unknown[0]!r} in {text!r}; known: {', '.join(APIS)}")
    return apis, match.group(2), match.group(3)


@dataclass(frozen=True)
class GrpcTls:
    """TLS for the gRPC endpoint: PEM files; ``mutual`` also requires clients to present a certificate signed by
    ``root_cert``."""

    server_cert: Path
    server_key: Path
    root_cert: Path | None = None
    mutual: bool = False

    def __post_init__(self) -> None:
        for name in ("server_cert", "server_key", "root_cert"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"grpc TLS {name} {path} is not a file")
        if self.mutual and self.root_cert is None:
            raise ValueError("mutual gRPC TLS needs a root certificate to check client certificates against")

    def args(self) -> list[str]:
        out = ["--grpc-use-ssl-mutual=true" if self.mutual else "--grpc-use-ssl=true",
               f"--grpc-server-cert={Path(self.server_cert).resolve()}",
               f"--grpc-server-key={Path(self.server_key).resolve()}"]
        if self.root_cert is not None:
            out.append(f"--grpc-root-cert={Path(self.root_cert).resolve()}")
        return out


@dataclass(frozen=True)
class SecurityOptions:
    """Access control and TLS of one tritonserver (see the module docstring).

    Attributes:
        admin_key: value of the ``dhisparse-admin-key`` header the admin APIs require; "" = random, never shown.
        admin_apis: the APIs restricted under that key (empty: none, e.g. when ``restrictions`` cover them).
        restrictions: further ``APIS:HEADER=VALUE`` restrictions, applied to HTTP and gRPC alike.
        grpc_tls: TLS for gRPC, or None.
        allow_http: serve HTTP at all (False: gRPC only).
    """

    admin_key: str = ""
    admin_apis: tuple[str, ...] = ADMIN_APIS
    restrictions: tuple[str, ...] = ()
    grpc_tls: GrpcTls | None = None
    allow_http: bool = True

    def __post_init__(self) -> None:
        if self.admin_key and not re.fullmatch(r"\S{16,}", self.admin_key):
            raise ValueError("admin_key must be at least 16 characters without spaces")
        unknown = [api for api in self.admin_apis if api not in APIS]
        if unknown:
            raise ValueError(f"unknown API {unknown[0]!r}; known: {', '.join(APIS)}")
        seen = set(self.admin_apis)
        for restriction in self.restrictions:
            apis, _, _ = parse_restriction(restriction)
            twice = seen.intersection(apis)
            if twice:
                raise ValueError(f"API {sorted(twice)[0]!r} is restricted twice (tritonserver takes one key per API)")
            seen.update(apis)

    def entries(self) -> list[str]:
        """Every restriction as ``APIS:HEADER=VALUE`` (the admin one with its key, random when none is set)."""
        out = []
        if self.admin_apis:
            key = self.admin_key or secrets.token_urlsafe(32)
            out.append(f"{','.join(self.admin_apis)}:{ADMIN_HEADER}={key}")
        return out + list(self.restrictions)

    def args(self) -> list[str]:
        """tritonserver flags."""
        out = []
        for entry in self.entries():
            out += [f"--http-restricted-api={entry}", f"--grpc-restricted-protocol={entry}"]
        if self.grpc_tls is not None:
            out += self.grpc_tls.args()
        if not self.allow_http:
            out.append("--allow-http=false")
        return out
