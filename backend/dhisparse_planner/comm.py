"""The collective bytes of one decode step of a planned deployment, from the runtime's own model of them.

The planner does not model communication itself: it describes its model as the runtime's
:class:`~dhisparse.engine.parallel.comm.ModelComm` (hidden and vocabulary sizes, layer counts, experts per token,
indexer layers) and its deployment as the runtime's :class:`~dhisparse.engine.parallel.shape.ParallelShape`
(``ModelSpec.attention_dp`` 1: tensor parallelism over the instance's ``gpus``; ``attention_dp = gpus``:
data-parallel attention, one rank per GPU), and prices a step with
:func:`~dhisparse.engine.parallel.comm.decode_comm_bytes` — the function the multi-rank engine's ``stats()`` is
tested against (``comm_bytes_<layer>_<op>``, tests/parallel/test_parallel_exactness.py). Units: bytes each rank
contributes per step. The runtime runs no shape with tensor parallelism inside data-parallel groups, so neither does
this (``ValueError``).
"""

from __future__ import annotations

from dhisparse.engine.parallel.comm import ModelComm, decode_comm_bytes
from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse_planner.specs import DSV32, GLM5, ModelSpec

MIB = 2**20
# Hidden and vocabulary sizes of the planned models' config.json (the figures specs.py's parameter counts use).
HIDDEN_AND_VOCAB = {GLM5.name: (6144, 154880), DSV32.name: (7168, 129280)}


def model_comm(spec: ModelSpec, hidden_size: int, vocab_size: int) -> ModelComm:
    """The runtime's description of ``spec``'s communication: its layers (the MoE ones and the dense rest), its
    routing and one DSA indexer per index group."""
    return ModelComm(hidden_size=hidden_size, vocab_size=vocab_size, num_layers=spec.num_layers,
                     dense_layers=spec.num_layers - spec.moe_layers, moe_layers=spec.moe_layers,
                     experts_per_token=spec.experts_per_token, indexer_rates=(1,) * spec.num_indexers)


def parallel_shape(spec: ModelSpec, expert_parallel: bool = False, split_indexer: bool = True) -> ParallelShape:
    """The runtime's shape of ``spec``'s deployment (module docstring)."""
    if spec.attention_dp == 1:
        return ParallelShape(spec.gpus, 1, expert_parallel, split_indexer)
    if spec.attention_dp == spec.gpus:
        return ParallelShape(1, spec.gpus, expert_parallel, split_indexer)
    raise ValueError(f"{spec.name}: attention_dp {spec.attention_dp} of {spec.gpus} GPUs splits attention inside "
                     "data-parallel groups, which the runtime does not run")


def step_comm_bytes(comm: ModelComm, spec: ModelSpec, batch_per_rank: int, context: int, dtype_bytes: int,
                    query_len: int = 1, expert_parallel: bool = False, split_indexer: bool = True
                    ) -> dict[str, float]:
    """Bytes each rank contributes in one decode (``query_len`` 1) or verification (``1 + gamma``) step with
    ``batch_per_rank`` requests per attention rank (under TP: the instance's batch) at KV length ``context``, by
    ``<layer>_<op>`` and ``total``."""
    return decode_comm_bytes(comm, parallel_shape(spec, expert_parallel, split_indexer), batch_per_rank, context,
                             dtype_bytes, query_len)


def comm_table(spec: ModelSpec = DSV32, contexts: tuple[tuple[str, int], ...] = (("32K", 32768), ("100K", 100_000)),
               batch: int = 32, dtype_bytes: int = 2) -> str:
    """docs/parallel.md's table: MiB per rank and decode step for TP (split and whole indexer), DP attention and
    DP attention + EP over ``spec.gpus`` GPUs, with the largest part at the first context."""
    comm = model_comm(spec, *HIDDEN_AND_VOCAB[spec.name])
    gpus = spec.gpus
    rows = [(f"TP {gpus}, batch {batch}, split indexer", spec.with_(attention_dp=1), False, True),
            (f"TP {gpus}, batch {batch}, whole indexer", spec.with_(attention_dp=1), False, False),
            (f"DP attention {gpus}, {batch} requests per rank", spec.with_(attention_dp=gpus), False, True),
            (f"DP attention {gpus} + EP, {batch} requests per rank", spec.with_(attention_dp=gpus), True, True)]
    lines = ["| shape | " + " | ".join(f"context {label}" for label, _ in contexts) + " | largest part |",
             "| --- |" + " --- |" * (len(contexts) + 1)]
    for label, shaped, ep, split in rows:
        steps = [step_comm_bytes(comm, shaped, batch, c, dtype_bytes, expert_parallel=ep, split_indexer=split)
                 for _, c in contexts]
        name, largest = max(((k, v) for k, v in steps[0].items() if k != "total"), key=lambda kv: kv[1])
        cells = " | ".join(f"{s['total'] / MIB:.0f} MiB" for s in steps)
        lines.append(f"| {label} | {cells} | {name}: {largest / MIB:.0f} MiB |")
    return "\n".join(lines)
