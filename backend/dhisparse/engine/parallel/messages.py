"""What the driver (the engine's process) and the ranks say to each other over the control channel.

The driver talks to rank 0 only (a local connection); rank 0 broadcasts each command to every rank over a gloo control
group and gathers their replies (``torch.distributed`` object collectives, the same on one host or several). Every
command that touches the engines carries the request operations queued since the previous one; a rank applies the
operations of its data-parallel group (all of them under tensor parallelism) before the command itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dhisparse.engine.request import RequestUpdate
from dhisparse.sampling.params import SamplingParams


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    group: int  # the data-parallel group (attention ranks) that owns the request
    imported: Any = None  # a generation engine's request: its context phase's parameters (engine/parallel/imports.py)


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str
    group: int


Op = Add | Abort


@dataclass(frozen=True)
class Step:
    """Apply ``ops``, run one engine step, and (data-parallel attention) pair the other ranks' forwards."""

    ops: tuple[Op, ...] = ()


@dataclass(frozen=True)
class PollIdle:
    """Apply ``ops`` and progress the KV store while no request runs."""

    ops: tuple[Op, ...] = ()


@dataclass(frozen=True)
class NeverAdmissible:
    """Why a request of this size could never be admitted (rank 0 answers; every rank has the same pool)."""

    prompt_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0 keeps the other ranks' control collectives from timing out while the engine is idle."""


@dataclass(frozen=True)
class Shutdown:
    pass


Command = Step | PollIdle | NeverAdmissible | Heartbeat | Shutdown


@dataclass
class Ready:
    """A rank's answer once its engine is built: what the driver needs to present the engine."""

    rank: int
    config: Any  # the rank's EngineConfig with pool_bytes resolved
    workspace: Any  # its WorkspaceBound (or None)
    max_model_len: int
    max_new_tokens_limit: int
    stats: dict[str, float]
    host: str
    imports: Any = None  # RankImports.describe of a generation engine's rank (None: prompts are prefilled here)


@dataclass
class Reply:
    """One rank's answer to a command. ``updates``: its data-parallel group's request updates (a step);
    ``digest``: a hash of the step's tokens and KV decisions (tensor-parallel ranks must agree); ``fatal``: the
    rank cannot go on (its collectives are broken); ``dead``: its engine stopped (``LLMEngine.dead``)."""

    rank: int
    updates: list[RequestUpdate] = field(default_factory=list)
    digest: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    answer: str | None = None
    dead: str | None = None
    fatal: str | None = None
