"""CUDA-graph capture of a step function per batch-size bucket, over fixed buffers.

At 60–80 layers a decode step is thousands of kernel launches; replaying a captured CUDA graph issues them as one.
A graph replays fixed addresses and shapes, so a step becomes graph-capturable when

- everything it reads per step comes from **fixed input buffers**, one set per batch-size bucket (the live batch is
  copied into the first rows; the padding rows hold a value the step treats as unused, e.g. position ``-1``);
- it writes its results into tensors that stay the same across replays (the outputs of the captured call);
- it never reads a device value on the host (``.item()``, ``nonzero``, a data-dependent shape): such a read
  cannot be captured and would freeze one step's value into every replay.

:class:`StepGraphs` holds the buffers, captures one graph per bucket on first use (after warm-up runs on a side
stream, all buckets sharing one memory pool) and replays it; on a CPU (or for a batch above the largest bucket) it
runs the same step eagerly over the same buffers. :func:`audit_step` finds what would break a capture — host reads,
data-dependent shapes, shapes that depend on the values — and runs anywhere, so CPU tests check a step's
capturability. The narrow interface (named buffers in, named tensors out) is all an executor needs to wire it in.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Buffers = dict[str, torch.Tensor]
Step = Callable[[Buffers], Mapping[str, torch.Tensor]]

# Operators that read device memory on the host or size their output by the data: never inside a captured step.
DEVICE_TO_HOST = "device-to-host copy"
HOST_READS = frozenset({
    "aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.nonzero_static", "aten.masked_select",
    "aten.unique", "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
    "aten.bincount", "aten.histc", "aten.repeat_interleave", "aten.equal", "aten.is_nonzero", "aten.tolist",
})


@dataclass(frozen=True)
class BufferSpec:
    """One named input buffer: ``row_shape`` per batch row (the batch dimension is added), its dtype and the value of
    padding rows."""

    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pad: int | float | bool = 0


@dataclass(frozen=True)
class GraphBuckets:
    """Ascending batch sizes a graph is captured for; a batch runs in the smallest bucket that holds it."""

    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"buckets must be distinct ascending sizes >= 1, got {self.sizes}")

    def bucket_for(self, batch: int) -> int | None:
        """The bucket of ``batch`` requests, or ``None`` above the largest (run eagerly)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None


class StaticBuffers:
    """The fixed input tensors of one bucket (allocated once; every step writes into them)."""

    def __init__(self, specs: Mapping[str, BufferSpec], rows: int, device: torch.device) -> None:
        self.rows = rows
        self.specs = dict(specs)
        self.tensors: Buffers = {name: torch.full((rows, *s.row_shape), s.pad, dtype=s.dtype, device=device)
                                 for name, s in self.specs.items()}

    def fill(self, values: Mapping[str, torch.Tensor]) -> None:
        """Copy each live value ``[batch, *row_shape]`` into its buffer's first rows, padding rows after them (no
        allocation on the device: ``copy_`` and ``fill_`` into the fixed tensors)."""
        missing = set(self.specs) - set(values)
        if missing or set(values) - set(self.specs):
            raise ValueError(f"step inputs must be exactly {sorted(self.specs)}, got {sorted(values)}")
        for name, value in values.items():
            buffer, spec = self.tensors[name], self.specs[name]
            batch = value.shape[0]
            if tuple(value.shape[1:]) != spec.row_shape or batch > self.rows:
                raise ValueError(f"input {name}: shape {list(value.shape)} does not fit [<= {self.rows}, "
                                 f"{', '.join(map(str, spec.row_shape))}]")
            buffer[:batch].copy_(value, non_blocking=True)
            if batch < self.rows:
                buffer[batch:].fill_(spec.pad)


class StepGraphs:
    """One captured CUDA graph of ``step`` per batch-size bucket (see the module docstring).

    ``step(buffers)`` reads only the buffers (``inputs`` specs, ``bucket`` rows each) and returns named tensors whose
    first dimension is the bucket's rows; :meth:`run` returns their first ``batch`` rows. Outputs of a replay are
    overwritten by the next one: copy what must outlive it."""

    def __init__(self, step: Step, inputs: Mapping[str, BufferSpec], device: torch.device,
                 buckets: GraphBuckets | None = None, warmup: int = 2, capture: bool | None = None) -> None:
        self.step, self.inputs, self.device = step, dict(inputs), torch.device(device)
        self.buckets = buckets or GraphBuckets()
        self.warmup = warmup
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._buffers: dict[int, StaticBuffers] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Mapping[str, torch.Tensor]]] = {}
        self._pool: Any = None  # torch.cuda.graph_pool_handle() of the first capture, shared by the others
        self.replays = 0
        self.eager_runs = 0

    def buffers(self, bucket: int) -> StaticBuffers:
        """The fixed inputs of ``bucket`` (made on first use)."""
        if bucket not in self._buffers:
            self._buffers[bucket] = StaticBuffers(self.inputs, bucket, self.device)
        return self._buffers[bucket]

    def run(self, batch: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step for the live ``batch`` (its ``inputs`` ``[batch, ...]``): replayed from its bucket's graph on CUDA,
        run eagerly over the same fixed buffers otherwise (and above the largest bucket, over ``inputs`` as given)."""
        bucket = self.buckets.bucket_for(batch)
        if bucket is None:
            self.eager_runs += 1
            return {k: v[:batch] for k, v in self.step(dict(inputs)).items()}
        buffers = self.buffers(bucket)
        buffers.fill(inputs)
        if not self.capture:
            self.eager_runs += 1
            return {k: v[:batch] for k, v in self.step(buffers.tensors).items()}
        graph, outputs = self._graphs.get(bucket) or self._capture(bucket, buffers)
        graph.replay()
        self.replays += 1
        return {k: v[:batch] for k, v in outputs.items()}

    def _capture(self, bucket: int, buffers: StaticBuffers) -> tuple[torch.cuda.CUDAGraph, Mapping[str, torch.Tensor]]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # lazy initialisation (cuBLAS handles, Triton compiles) outside the capture
                self.step(buffers.tensors)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = dict(self.step(buffers.tensors))
        self._graphs[bucket] = (graph, outputs)
        return graph, outputs


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))
        self.ops.append((str(func.overloadpacket._qualified_op_name).replace("::", "."), shapes))
        return out


def audit_step(step: Step, variants: Sequence[Mapping[str, torch.Tensor]]) -> list[str]:
    """What would break a CUDA-graph capture of ``step``, found by running it (any device) on each of ``variants``
    (buffer sets of one bucket with different values): operators that read device memory on the host or size their
    output by the data (:data:`HOST_READS`), copies from a device to the host (visible when the step runs on a GPU:
    on a CPU every tensor is on the host), and any operator whose output shapes differ between the variants.
    Returns one line per problem (empty: capturable as far as these runs show)."""
    runs = []
    for buffers in variants:
        recorder = _Recorder()
        with recorder:
            step(dict(buffers))
        runs.append(recorder.ops)
    problems = sorted({f"host read or data-dependent shape: {name}" for ops in runs for name, _ in ops
                       if name in HOST_READS or name.startswith(DEVICE_TO_HOST)})
    first = runs[0]
    for other in runs[1:]:
        if [n for n, _ in other] != [n for n, _ in first]:
            problems.append("the operators run depend on the values (a data-dependent branch)")
            break
        for (name, shapes), (_, other_shapes) in zip(first, other, strict=True):
            if shapes != other_shapes:
                problems.append(f"output shape of {name} depends on the values: {shapes} vs {other_shapes}")
                break
    return problems
