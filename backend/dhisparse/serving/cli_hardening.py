"""`dhisparse-serve`'s hardening flags: access control, TLS, the operator's Triton, limits, keys, shutdown.

Kept apart from `cli.py` (argparse stays at the edge: these functions only add arguments and turn the parsed values
into the frozen option objects the server and the repository take). docs/security.md describes a hardened
deployment with them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dhisparse.serving.internal_auth import read_key_file, write_key_file
from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.triton_install import TritonInstall
from dhisparse.serving.triton_security import GrpcTls, SecurityOptions

FIXED_TRITON_VERSION = (2, 59)  # NGC 25.07: the release the 2025 HTTP / Python-backend advisories name as fixed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("access control and TLS (docs/security.md)")
    s.add_argument("--admin-key-file", type=Path, default=None, metavar="PATH",
                   help="file (mode 0600) holding the key that the restricted admin APIs (model-repository, "
                        "shared-memory, trace, logging) require in header dhisparse-admin-key; default: a random key "
                        "nobody knows, i.e. no remote model control")
    s.add_argument("--restrict-api", action="append", default=[], metavar="APIS:HEADER=VALUE",
                   help="restrict more APIs (comma-separated; e.g. inference) to requests carrying HEADER: VALUE, over "
                        "HTTP and gRPC; repeatable")
    s.add_argument("--grpc-tls-cert", type=Path, default=None, metavar="PEM", help="gRPC TLS: server certificate")
    s.add_argument("--grpc-tls-key", type=Path, default=None, metavar="PEM", help="gRPC TLS: server private key")
    s.add_argument("--grpc-tls-root-cert", type=Path, default=None, metavar="PEM",
                   help="gRPC TLS: root certificate (clients' CA with --grpc-tls-mutual)")
    s.add_argument("--grpc-tls-mutual", action="store_true", help="gRPC TLS: require client certificates")
    s.add_argument("--no-http", action="store_true",
                   help="serve no HTTP (tritonserver has no HTTP TLS: serve gRPC with TLS, or put HTTP behind a TLS "
                        "proxy with --http-address 127.0.0.1)")
    s.add_argument("--http-address", default="", help="address of the HTTP endpoint only (default: --address)")
    s.add_argument("--metrics-address", default="", help="address of the metrics endpoint only (default: --address)")
    s.add_argument("--triton-root", type=Path, default=None, metavar="DIR",
                   help="run the operator's Triton installed as an NGC container's /opt/tritonserver (bin/, lib/, "
                        "backends/python/); default: the server bundled with nvidia-pytriton (development)")
    r = parser.add_argument_group("requests and shutdown")
    r.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                   help="a per-request limit (dhisparse/serving/limits.py: max_request_bytes, max_batch, "
                        "max_prompt_tokens, max_prompt_bytes, max_num_return_sequences, max_sequences, max_words, "
                        "max_word_bytes, max_word_tokens, max_bias_words); repeatable")
    r.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="on SIGTERM, seconds open requests may still finish before they are answered with an error")
    r.add_argument("--allow-stop-by-request-id", action="store_true",
                   help="honour tensorrtllm's `stop` input (stops the open request with that request id: only where "
                        "every client is trusted, as any client may name any id)")
    r.add_argument("--auth-key-file", type=Path, default=None, metavar="PATH",
                   help="the deployment's internal key (mode 0600; default: a fresh one per start); both servers of a "
                        "two-host disaggregated deployment need the same file")
    r.add_argument("--new-key-file", type=Path, default=None, metavar="PATH",
                   help="write a new random key to PATH (mode 0600) and exit")


def security_options(args: argparse.Namespace) -> SecurityOptions:
    """The SecurityOptions of the parsed flags; ValueError naming the flag at fault."""
    admin_key = ""
    if args.admin_key_file is not None:
        admin_key = read_key_file(args.admin_key_file).hex()
    tls = None
    if args.grpc_tls_cert or args.grpc_tls_key:
        if not (args.grpc_tls_cert and args.grpc_tls_key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        tls = GrpcTls(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_root_cert, args.grpc_tls_mutual)
    elif args.grpc_tls_mutual or args.grpc_tls_root_cert:
        raise ValueError("--grpc-tls-root-cert / --grpc-tls-mutual need --grpc-tls-cert and --grpc-tls-key")
    return SecurityOptions(admin_key=admin_key, restrictions=tuple(args.restrict_api), grpc_tls=tls,
                           allow_http=not args.no_http)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**RequestLimits.parse_overrides(args.limit))


def triton_install(args: argparse.Namespace) -> TritonInstall:
    return TritonInstall.from_root(args.triton_root) if args.triton_root else TritonInstall.locate()


def new_key_file(path: Path) -> str:
    """``--new-key-file``: write the key; the line to print."""
    if path.exists():
        raise ValueError(f"--new-key-file {path} exists; remove it first (keys are never overwritten)")
    write_key_file(path)
    return f"dhisparse-serve: wrote a new key to {path} (mode 0600)"


def version_warning(version: str) -> str | None:
    """A warning for a Triton older than the release that fixed the 2025 advisories (None: recent enough)."""
    parts = version.split(".")
    try:
        number = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None
    if number >= FIXED_TRITON_VERSION:
        return None
    return (f"dhisparse-serve: warning: tritonserver {version} predates Triton 2.59 (NGC 25.07), which fixed published "
            "HTTP and Python-backend advisories (CVE-2025-23310, -23311, -23319, -23320, -23334); the bundled server "
            "is for development: in production use --triton-root with an NGC 25.07+ container (docs/security.md)")
