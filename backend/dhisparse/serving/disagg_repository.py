"""Fill the model repository for disaggregated serving (tensorrtllm_backend's `all_models/disaggregated_serving/`).

Models: `context` and `generation` (each its own Python-backend stub process, i.e. its own engine process) and
the orchestrator `disaggregated_serving_bls`; with a tokenizer also `preprocessing`, `postprocessing` and the
`ensemble`, whose LLM step then calls the orchestrator instead of `dhisparse`, so clients keep `text_input`,
`max_tokens`, `stream`, … → `text_output` unchanged.

Roles (:class:`DisaggregatedOptions`), so that the two engine processes can run on two hosts: ``both`` (one server:
every model above), ``context`` (a server that serves only `context`), ``generation`` (`generation`, the orchestrator
and the text models; the orchestrator calls the `context` model of the server at ``context_url`` over gRPC). The
NIXL options become model parameters (``nixl.*``) of `context` and `generation`, ``context_url`` one of the
orchestrator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dhisparse.serving.repository import LLM_MODEL, RepositorySpec, fill_model_repository, set_parameter
from dhisparse.serving.ucx_binding import net_devices

DISAGGREGATED_MODELS = ("context", "generation", "disaggregated_serving_bls")
ORCHESTRATOR = "disaggregated_serving_bls"


ROLES = ("both", "context", "generation")


@dataclass(frozen=True)
class DisaggregatedOptions:
    """Which models a server runs and how its roles find each other.

    Attributes:
        role: ``both``, ``context`` or ``generation`` (see the module docstring).
        context_url: gRPC ``HOST:PORT`` of the context server; required for ``generation``, refused otherwise.
        nixl_agent_name: NIXL agent name prefix (``<prefix>-context`` / ``<prefix>-generation``); agents that talk
            to each other must have distinct names, so give each server of a fleet its own prefix.
        transfer_timeout_s: the generation side's limit for one READ.
        hold_timeout_s: how long the context side holds a region nobody reads or cancels.
        address: the server's address; ``ucx_net_devices = "auto"`` binds UCX to its interface.
        ucx_net_devices: ``UCX_NET_DEVICES`` of both agents (``auto``: the interface of ``address``).
        arena_limit_bytes: the most bytes the context side holds for transfer at once (its arenas never exceed it).
    """

    role: str = "both"
    context_url: str = ""
    nixl_agent_name: str = "dhisparse"
    transfer_timeout_s: float = 30.0
    hold_timeout_s: float = 60.0
    address: str = "127.0.0.1"
    ucx_net_devices: str = "auto"
    arena_limit_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role == "generation" and not self.context_url:
            raise ValueError("context_url (HOST:PORT of the context server's gRPC endpoint) is required for the "
                             "generation role")
        if self.context_url and self.role != "generation":
            raise ValueError(f"context_url is only for the generation role, not {self.role!r}")
        if self.context_url and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", self.context_url):
            raise ValueError(f"context_url must be HOST:PORT, got {self.context_url!r}")
        if not re.fullmatch(r"[\w.-]+", self.nixl_agent_name):
            raise ValueError(f"nixl_agent_name must be letters, digits, '.', '_' or '-', got {self.nixl_agent_name!r}")
        for name in ("transfer_timeout_s", "hold_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.arena_limit_bytes < 1 << 20:
            raise ValueError(f"arena_limit_bytes must be >= 1 MiB, got {self.arena_limit_bytes}")
        if not re.fullmatch(r"[\w.:,-]*", self.ucx_net_devices):
            raise ValueError(f"ucx_net_devices must be interface names (comma-separated) or auto, got "
                             f"{self.ucx_net_devices!r}")
        net_devices(self.ucx_net_devices, self.address)  # ValueError when no interface carries the address

    def models(self, has_tokenizer: bool) -> tuple[str, ...]:
        if self.role == "context":
            return ("context",)
        text = ("preprocessing", "postprocessing", "ensemble") if has_tokenizer else ()
        engines = DISAGGREGATED_MODELS if self.role == "both" else ("generation", ORCHESTRATOR)
        return (*engines, *text)


def fill_disaggregated_repository(spec: RepositorySpec, output_dir: Path, templates_dir: Path | None = None,
                                  options: DisaggregatedOptions | None = None) -> list[str]:
    """Write the disaggregated repository (the models of ``options.role``) to ``output_dir``; returns their names."""
    options = options or DisaggregatedOptions()
    if options.role != "both" and spec.auth_key_file is None:
        raise ValueError(f"role {options.role!r}: the context and generation servers must share one key file "
                         "(dhisparse-serve --auth-key-file PATH on both; create it with dhisparse-serve --new-key-file "
                         "PATH)")
    models = fill_model_repository(spec, output_dir, templates_dir, options.models(spec.has_tokenizer))
    devices = net_devices(options.ucx_net_devices, options.address)
    if "context" in models:
        config = output_dir / "context" / "config.pbtxt"
        set_parameter(config, "nixl.agent_name", f"{options.nixl_agent_name}-context")
        set_parameter(config, "nixl.hold_timeout_s", f"{options.hold_timeout_s:g}")
        set_parameter(config, "nixl.arena_limit_bytes", str(options.arena_limit_bytes))
        set_parameter(config, "nixl.ucx_net_devices", devices)
    if "generation" in models:
        config = output_dir / "generation" / "config.pbtxt"
        set_parameter(config, "nixl.agent_name", f"{options.nixl_agent_name}-generation")
        set_parameter(config, "nixl.transfer_timeout_s", f"{options.transfer_timeout_s:g}")
        set_parameter(config, "nixl.ucx_net_devices", devices)
    if ORCHESTRATOR in models:
        set_parameter(output_dir / ORCHESTRATOR / "config.pbtxt", "context_url", options.context_url)
    if "ensemble" in models:
        config = output_dir / "ensemble" / "config.pbtxt"
        before = config.read_text()
        step = f'model_name: "{LLM_MODEL}"'
        if before.count(step) != 1:
            raise ValueError(f"{config}: expected one ensemble step calling {LLM_MODEL!r} to replace")
        orchestrator = (output_dir / ORCHESTRATOR / "config.pbtxt").read_text()
        config.write_text(restrict_ensemble(before.replace(step, f'model_name: "{ORCHESTRATOR}"'),
                                            _declared(orchestrator, "input"), _declared(orchestrator, "output")))
    return models


def _block(config: str, section: str) -> str:
    match = re.search(rf"^{section} \[\n(.*?)^\]", config, re.M | re.S)
    return match.group(1) if match else ""


def _declared(config: str, section: str) -> set[str]:
    """Tensor names of a config's top-level ``input [...]`` or ``output [...]`` block."""
    return set(re.findall(r'name: "([^"]+)"', _block(config, section)))


def restrict_ensemble(ensemble: str, inputs: set[str], outputs: set[str]) -> str:
    """The ensemble limited to what the orchestrator declares: its step's input/output maps to tensors the
    orchestrator lacks are dropped, and so are the ensemble inputs and outputs nothing uses any more. (The
    orchestrator serves the core surface; tensorrtllm_backend's whole surface is the co-located `dhisparse`'s.)"""
    start = ensemble.index(f'model_name: "{ORCHESTRATOR}"')
    end = ensemble.index("\n    }", start)
    step = ensemble[start:end]
    dropped_in = re.findall(r'input_map \{ key: "([^"]+)" value: "([^"]+)" \}', step)
    dropped_out = re.findall(r'output_map \{ key: "([^"]+)" value: "([^"]+)" \}', step)
    lines = [line for line in step.split("\n")
             if not any(f'input_map {{ key: "{k}" ' in line for k, _ in dropped_in if k not in inputs)
             and not any(f'output_map {{ key: "{k}" ' in line for k, _ in dropped_out if k not in outputs)]
    ensemble = ensemble[:start] + "\n".join(lines) + ensemble[end:]
    gone_out = {v for k, v in dropped_out if k not in outputs}
    # Intermediate tensors (another step's outputs) that nothing consumes any more go too.
    consumed = set(re.findall(r'input_map \{ key: "[^"]+" value: "([^"]+)" \}', ensemble))
    intermediate = re.compile(r'output_map \{ key: "[^"]+" value: "(_[^"]+)" \}')
    ensemble = "\n".join(line for line in ensemble.split("\n")
                         if not ((m := intermediate.search(line)) and m.group(1) not in consumed))
    used = set(re.findall(r'value: "([^"]+)"', ensemble[ensemble.index("ensemble_scheduling"):]))
    for section, keep in (("input", lambda name: name in used), ("output", lambda name: name not in gone_out)):
        block = _block(ensemble, section)
        kept = [line for line in block.split("\n")
                if not (m := re.search(r'name: "([^"]+)"', line)) or keep(m.group(1))]
        text = "\n".join(kept).rstrip().rstrip(",") + "\n"
        ensemble = ensemble.replace(block, text, 1)
    return ensemble
