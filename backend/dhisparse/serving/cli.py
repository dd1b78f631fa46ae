"""`dhisparse-serve`: serve an engine through a real Triton Inference Server (argparse lives only here).

Prepares the Python backend directory and a model repository filled for the engine (in `--model-repo`,
or a temporary directory removed at exit), starts `tritonserver` bound to `--address` (loopback by
default), prints one `ready` line, and on SIGINT/SIGTERM stops the server cleanly: the models refuse new requests and
answer every open one (finished within `--shutdown-grace`, or with an error), then tritonserver exits, leaving no
process and no shared memory. If the engine stops after a fault it cannot recover from (the `dhisparse` model turns
not-ready), it stops the server and exits with code 3. Hardening flags: `cli_hardening.py`, docs/security.md.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import tempfile
import threading
from pathlib import Path

from dhisparse.serving import cli_hardening
from dhisparse.serving.disagg_repository import DisaggregatedOptions, fill_disaggregated_repository
from dhisparse.serving.openai import server as openai_server
from dhisparse.serving.repository import (
    TEXT_MODELS,
    RepositorySpec,
    claim_repository,
    fill_model_repository,
    parse_override,
)
from dhisparse.serving.server import ServerConfig, ServerStartError, TritonServer, free_ports
from dhisparse.serving.triton_install import TritonNotInstalledError, prepare_backend_dir

LLM_MODEL = "dhisparse"  # the model that runs the engine; its readiness is the engine's

# Runtime options with their own flags (everything else: --engine-option KEY=VALUE).
_ENGINE_FLAGS = (
    ("kv_policy", str, "KV policy: resident, hisparse, adaptive or dense"),
    ("pool_bytes", lambda v: 0 if v == "auto" else int(v),
     "device KV pool budget in bytes, or 'auto' (free device memory less the workspace bound)"),
    ("hot_rows", int, "hot-cache rows per request and source"),
    ("page_rows", int, "rows per KV page"),
    ("reserve_bytes", int, "admission reserve in bytes"),
    ("max_batch_size", int, "engine batch size (running requests)"),
    ("speculative", str, "speculative decoding: dflash, dflash2 or dspark (a packed drafter family)"),
    ("num_draft_tokens", int, "draft tokens per speculation step"),
    ("tensor_parallel_size", int, "ranks splitting attention heads, the indexer and the MLPs (docs/parallel.md)"),
    ("data_parallel_size", int, "data-parallel attention ranks, each with its own requests and KV"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dhisparse-serve", description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, type=Path, help="engine directory built by dhisparse-build")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (0: pick a free one)")
    p.add_argument("--metrics-port", type=int, default=8002, help="metrics port (0: pick a free one)")
    p.add_argument("--address", default="127.0.0.1", help="address every endpoint binds to")
    p.add_argument("--model-repo", type=Path, default=None,
                   help="where to write the filled model repository (default: a temporary directory)")
    p.add_argument("--templates", type=Path, default=None, help="model repository templates (default: the repo's)")
    p.add_argument("--metrics-interval-ms", type=int, default=250, help="engine metrics refresh period")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--log-file", type=Path, default=None, help="write the server log here (default: terminal)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument("--exclude-input-in-output", choices=("true", "false"), default="true",
                   help="default for requests that do not send exclude_input_in_output (tensorrtllm_backend's "
                        "parameter of that name): false = non-streaming outputs start with the prompt")
    p.add_argument("--disaggregated", action="store_true",
                   help="prefill/decode disaggregation: `context` and `generation` engine processes joined by NIXL, "
                        "orchestrated by `disaggregated_serving_bls` (see docs/disaggregated.md)")
    d = p.add_argument_group("disaggregated serving on two hosts (imply --disaggregated)")
    d.add_argument("--role", choices=("both", "context", "generation"), default=None,
                   help="both: every model in this server (the default of --disaggregated); context: only the "
                        "`context` (prefill) engine; generation: the `generation` engine, the orchestrator and the "
                        "text models, calling the context server named by --context-url")
    d.add_argument("--context-url", default="", metavar="HOST:PORT",
                   help="gRPC endpoint of the context server (its --address and --grpc-port); --role generation")
    d.add_argument("--nixl-agent-name", default="dhisparse", metavar="PREFIX",
                   help="NIXL agent name prefix (agents <PREFIX>-context / <PREFIX>-generation); distinct per server "
                        "when several context servers feed one generation server. NIXL needs no listening port: "
                        "agent metadata travels inside context_phase_params; UCX picks the interfaces "
                        "(set UCX_NET_DEVICES / UCX_TLS in the environment to choose)")
    d.add_argument("--nixl-transfer-timeout", type=float, default=30.0, metavar="S",
                   help="generation side: seconds one history READ may take before the request fails")
    d.add_argument("--nixl-hold-timeout", type=float, default=60.0, metavar="S",
                   help="context side: seconds a region nobody reads or cancels is held")
    d.add_argument("--nixl-arena-limit", type=int, default=1 << 30, metavar="BYTES",
                   help="context side: most bytes of histories held for transfer at once (a prefill beyond it fails)")
    d.add_argument("--ucx-net-devices", default="auto", metavar="DEVICES",
                   help="UCX_NET_DEVICES of the NIXL agents (e.g. eth0, lo); auto: the interface of --address "
                        "(all interfaces for 0.0.0.0)")
    cli_hardening.add_arguments(p)
    g = p.add_argument_group("engine runtime options (override the engine's runtime.json)")
    for name, kind, help_text in _ENGINE_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=help_text)
    g.add_argument("--expert-parallel", dest="expert_parallel", action="store_const", const=True, default=None,
                   help="partition MoE experts across the ranks (with --tensor-parallel-size or --data-parallel-size)")
    g.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other runtime option (value parsed as JSON when possible); repeatable")
    openai_server.add_arguments(p)
    return p.parse_args(argv)


def engine_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Runtime overrides from the dedicated flags and `--engine-option KEY=VALUE` entries."""
    overrides: dict[str, object] = {}
    for option in args.engine_option:
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option expects KEY=VALUE, got {option!r}")
        overrides[key.strip().replace("-", "_")] = parse_override(value)
    for name in [*(flag[0] for flag in _ENGINE_FLAGS), "expert_parallel"]:
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return overrides


def _disaggregated_options(args: argparse.Namespace) -> DisaggregatedOptions | None:
    """The disaggregated deployment's options (None: co-located); raises ValueError naming the flag at fault."""
    if not args.disaggregated and args.role is None:
        if args.context_url:
            raise ValueError("--context-url needs --role generation")
        return None
    return DisaggregatedOptions(args.role or "both", args.context_url, args.nixl_agent_name,
                                args.nixl_transfer_timeout, args.nixl_hold_timeout, address=args.address,
                                ucx_net_devices=args.ucx_net_devices, arena_limit_bytes=args.nixl_arena_limit)


def _ports(args: argparse.Namespace, address: str) -> tuple[int, int, int]:
    wanted = [args.http_port, args.grpc_port, args.metrics_port]
    spare = iter(free_ports(wanted.count(0), address))
    return tuple(port or next(spare) for port in wanted)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--new-key-file" in argv:  # the one flag that needs no engine
        try:
            print(cli_hardening.new_key_file(Path(argv[argv.index("--new-key-file") + 1])))
            return 0
        except (IndexError, ValueError, OSError) as error:
            print(f"dhisparse-serve: error: {error}", file=sys.stderr)
            return 2
    args = parse_args(argv)
    try:
        disaggregated = _disaggregated_options(args)
        install = cli_hardening.triton_install(args)
        security = cli_hardening.security_options(args)
        spec = RepositorySpec(args.engine, engine_overrides(args), metrics_interval_ms=args.metrics_interval_ms,
                              exclude_input_in_output=args.exclude_input_in_output == "true",
                              limits=cli_hardening.request_limits(args), auth_key_file=args.auth_key_file,
                              shutdown_grace_s=args.shutdown_grace,
                              allow_stop_by_request_id=args.allow_stop_by_request_id)
        if not (spec.engine_dir / "config.json").is_file():
            raise ValueError(f"{spec.engine_dir} is not an engine directory (no config.json)")
        if args.model_repo is not None:
            planned = disaggregated.models(spec.has_tokenizer) if disaggregated is not None else (
                (LLM_MODEL, *TEXT_MODELS) if spec.has_tokenizer else (LLM_MODEL,))
            claim_repository(args.model_repo, planned)
        if args.openai_port is not None and args.role == "context":
            raise ValueError("--openai-port needs the generation side (--role both or generation), not --role context")
        http, grpc, metrics = _ports(args, args.address)
        openai = openai_server.from_arguments(args, spec.engine_dir, f"{args.address}:{grpc}", spec.engine_overrides,
                                              spec.resolved_limits())
    except (TritonNotInstalledError, ValueError, TypeError) as error:
        print(f"dhisparse-serve: error: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dhisparse-serve-") as work:
        model_repo = args.model_repo or Path(work) / "model_repository"
        model_repo.mkdir(mode=0o700, parents=True, exist_ok=True)
        if disaggregated is not None:
            models = fill_disaggregated_repository(spec, model_repo, args.templates, disaggregated)
        else:
            models = fill_model_repository(spec, model_repo, args.templates)
        backend_dir = prepare_backend_dir(install, Path(work) / "backends")
        config = ServerConfig(model_repo, backend_dir, http, grpc, metrics, args.address, args.log_verbose,
                              security=security, load_models=tuple(models), http_address=args.http_address,
                              metrics_address=args.metrics_address,
                              # after the drain nothing of ours is open: what Triton still counts as in flight is an
                              # ensemble whose streamed step failed (2.51 keeps counting it); a SIGKILLed launcher's
                              # models end their streams after the grace, within this
                              exit_timeout_s=math.ceil(args.shutdown_grace) + 3,
                              drain_timeout_s=args.shutdown_grace + 5)
        server = TritonServer(config, install, args.log_file)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        try:
            server.start(timeout_s=args.startup_timeout)
            if openai is not None:  # beside Triton, calling its gRPC endpoint (dhisparse.serving.openai)
                openai.start()
                print(f"dhisparse-serve: openai={openai.url} model={openai.serving.model_name}", flush=True)
        except (ServerStartError, RuntimeError) as error:
            server.stop()
            print(f"dhisparse-serve: error: {error}", file=sys.stderr)
            return 1
        warning = cli_hardening.version_warning(server.version)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        print(f"dhisparse-serve: ready models={','.join(models)} http={config.http_url} grpc={config.grpc_url} "
              f"metrics={config.metrics_url} pid={server.pid} triton={server.version or 'unknown'}", flush=True)
        # The engine models that unload themselves when their engine stops: `dhisparse`, and `generation` of the
        # disaggregated deployment (`context` answers each prefill on its own and does not).
        watched = next((m for m in (LLM_MODEL, "generation") if m in models), None)
        while not stop.wait(0.5):
            server.secure_shared_memory()
            if server.poll() is not None:  # died on its own
                openai_server.stop(openai)
                code = server.stop()
                print(f"dhisparse-serve: tritonserver exited with code {code}", file=sys.stderr)
                return 1
            if watched and not server.model_ready(watched) and not stop.is_set() and server.poll() is None:
                # The engine stopped after a fault it could not recover from: its clients have their errors and
                # the model unloaded itself. Stop the server so that its health endpoint stops answering ready
                # too (Triton 2.51 counts only loaded models), and exit non-zero for the supervisor to restart us.
                print(f"dhisparse-serve: error: model {watched!r} is no longer ready (its engine stopped after "
                      "a fault; see the server log); stopping tritonserver", file=sys.stderr, flush=True)
                openai_server.stop(openai)
                server.stop()
                return 3
        print("dhisparse-serve: stopping: refusing new requests, answering the open ones", flush=True)
        openai_server.stop(openai)
        code = server.stop()
        print(f"dhisparse-serve: stopped (tritonserver exit code {code})", flush=True)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
