"""Request state inside the engine and what the engine reports about it."""

from __future__ import annotations

import enum
import time
import zlib
from dataclasses import dataclass, field

import torch

from dhisparse.sampling.params import SamplingParams
from dhisparse.sampling.sampler import seed_to_int64


def request_seed(params: SamplingParams, request_id: str) -> int:
    """A request's random stream (int64 bit pattern): from ``params.seed``, else from its id. One rule for every
    engine (one process or several ranks), so seeded sampling is the same wherever the request runs."""
    return seed_to_int64(params.seed if params.seed is not None else zlib.crc32(request_id.encode()))


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission (never dropped)
    RUNNING = "running"  # prefilled, in the decode batch
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # int64 bit pattern of the request's random stream
    arrival_time: float = field(default_factory=time.perf_counter)
    arrival_wall_ns: int = field(default_factory=time.time_ns)  # the same instant on the wall clock
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV rows are stored
    finish_reason: str | None = None
    first_token_time: float | None = None
    admitted_time: float | None = None
    finish_time: float | None = None
    spec_state: int | None = None  # the drafter's ring slot when speculating
    kv_admitted: bool = False  # the KV manager holds memory for it (try_admit said yes, not released yet)
    error: str | None = None  # why it failed (finish_reason "error")
    counters: dict[str, float] = field(default_factory=dict)
    last_token_time: float | None = None
    token_counts: torch.Tensor | None = None  # [V] float32 counts of prompt + output tokens (penalties only)
    context_logits: torch.Tensor | None = None  # [prompt_len, V] until sent with the first update
    cum_log_prob: float = 0.0  # sum of the generated tokens' log-probabilities (when params.logprobs)
    output_log_probs: list[float] = field(default_factory=list)  # per generated token (when params.logprobs)
    stop_ids: frozenset[int] = frozenset()  # params.stop_token_ids, as a set (set at creation)
    processes_logits: bool = False  # params.processes_logits (set at creation)

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids)
        self.processes_logits = self.params.processes_logits

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1]

    def timing(self) -> dict[str, float]:
        out: dict[str, float] = {"prompt_tokens": float(self.prompt_len),
                                 "output_tokens": float(len(self.output_token_ids))}
        if self.first_token_time is not None:
            out["ttft_s"] = self.first_token_time - self.arrival_time
        if self.admitted_time is not None:
            out["queue_s"] = self.admitted_time - self.arrival_time
        if self.finish_time is not None and self.first_token_time is not None and len(self.output_token_ids) > 1:
            out["tpot_s"] = (self.finish_time - self.first_token_time) / (len(self.output_token_ids) - 1)
        # The same instants as wall-clock nanoseconds since the epoch (TensorRT-LLM's perf-metrics outputs).
        for name, value in (("arrival_time_ns", self.arrival_time), ("first_scheduled_time_ns", self.admitted_time),
                            ("first_token_time_ns", self.first_token_time),
                            ("last_token_time_ns", self.last_token_time)):
            if value is not None:
                out[name] = float(self.arrival_wall_ns + round((value - self.arrival_time) * 1e9))
        return out


@dataclass
class RequestUpdate:
    """Tokens produced for one request by one engine step (streaming unit)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)  # on the finishing update (every one: perf_metrics)
    new_log_probs: list[float] | None = None  # per new token, when params.logprobs
    new_logits: torch.Tensor | None = None  # [len(new_token_ids), V] processed logits, params.generation_logits
    context_logits: torch.Tensor | None = None  # [prompt_len, V] on the first update, params.context_logits
    error: str | None = None  # with finish_reason "error": what failed


@dataclass
class RequestOutput:
    """Final result of one request from ``LLM.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or "error" (see ``error``)
    stats: dict[str, float]
    log_probs: list[float] | None = None  # per generated token, when SamplingParams.logprobs
    error: str | None = None
