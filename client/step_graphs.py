"""The batched trainer's local steps replayed as CUDA graphs, so a round is not bound by Python or
by kernel launches.

A step of the batched trainer (client/batched.py) is a few hundred small kernels: a forward and
backward pass of K stacked models, then the optimiser's in-place updates. For small models (a
logistic regression, the 2NN, a GRU over 20 time steps) the GPU finishes each kernel before Python
has issued the next, so the round is as slow as the interpreter. A CUDA graph records the
kernels of one step once and replays them with a single launch.

What makes a step replayable: every tensor it reads or writes lives at a fixed address for the
whole chunk (the stacked parameters, the momentum, the batch plan, the data, the loss sums), and
the step number is a one-element tensor on the device that the step itself increments, so the
same recorded kernels pick the next batch at each replay. The number of clients still training
(``active``) decides the shapes, so one graph is recorded for each run of steps with the same
count; the clients are sorted by their number of steps, so there are few such runs.

Each run of steps goes: ``warmup`` steps eagerly on a side stream (cuDNN's autotuner and lazy
initialisation happen there, as PyTorch's graph documentation asks), one capture (which records
and does not execute: the step counter does not move), then one replay per remaining step. Runs
too short to pay for a capture run eagerly. If a capture fails (an operation that cannot be
recorded, such as one that waits for the host), the trainer says so once and runs eagerly from
then on: the capture executed nothing, so no step is lost or repeated.

On a CPU, and with ``simulation.cuda_graphs = false``, the same step function runs eagerly; tests
compare both ways on a GPU, and the bookkeeping on a CPU with a recorder that behaves as a graph
does (records at capture, runs at each replay).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # eager steps before a capture: autotuning and lazy initialisation happen there
MIN_REPLAYS = 4  # a run of steps shorter than warmup + 1 + this runs eagerly: a capture would not pay


class StepGraph(Protocol):
    """One recorded step: :meth:`capture` records ``step`` without running it, :meth:`replay` runs the
    recording."""

    def capture(self, step: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaStepGraph:
    """A :class:`StepGraph` on ``torch.cuda.CUDAGraph``; graphs of one chunk share a memory pool."""

    def __init__(self, pool: Any = None):  # a memory pool handle (graph.pool()) or None
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, step: Callable[[], None]) -> None:
        # the step's backward pass runs on autograd's device thread, into the capturing stream, as in
        # PyTorch's whole-network capture example
        with torch.cuda.graph(self.graph, pool=self.pool):
            step()

    def replay(self) -> None:
        self.graph.replay()


def runs(active: Sequence[int]) -> list[tuple[int, int]]:
    """``(active, steps)`` for each run of consecutive steps with the same number of active clients."""
    out: list[tuple[int, int]] = []
    for a in active:
        if out and out[-1][0] == a:
            out[-1] = (a, out[-1][1] + 1)
        else:
            out.append((a, 1))
    return out


class StepRunner:
    """Runs a chunk's steps, eagerly or as graph replays (module doc).

    ``make_graph(previous)`` makes an empty :class:`StepGraph` (``previous``: the chunk's last one,
    whose memory pool it may share, or None); None runs every step eagerly."""

    def __init__(self, make_graph: Callable[[StepGraph | None], StepGraph] | None, device: torch.device):
        self.make_graph = make_graph
        self.device = device
        self.captured = 0  # graphs recorded (for logs and tests)
        self.replays = 0
        self.failed = False  # a capture failed: the rest ran eagerly

    @staticmethod
    def cuda_graphs(device: torch.device, enabled: bool) -> Callable[[StepGraph | None], StepGraph] | None:
        """The ``make_graph`` of CUDA graphs on a CUDA device when ``enabled``, else None (eager steps)."""
        if not (enabled and device.type == "cuda"):
            return None

        def make(previous: StepGraph | None) -> StepGraph:
            return CudaStepGraph(previous.graph.pool() if isinstance(previous, CudaStepGraph) else None)

        return make

    def run(self, step: Callable[[int], None], active: Sequence[int]) -> None:
        """``step(a)`` once for each entry ``a`` of ``active`` (the clients training at each step), in order."""
        previous: StepGraph | None = None
        for a, n in runs(active):
            if self.make_graph is None or n < WARMUP_STEPS + 1 + MIN_REPLAYS:
                for _ in range(n):
                    step(a)
                continue
            with self._side_stream():
                for _ in range(WARMUP_STEPS):
                    step(a)
            graph = self.make_graph(previous)
            try:
                graph.capture(functools.partial(step, a))
            except Exception as e:  # noqa: BLE001 - anything unrecordable: say so once, finish eagerly
                log.warning(
                    "simulation.cuda_graphs: the batched step could not be recorded as a CUDA graph "
                    "(%s: %s); training eagerly from here on",
                    type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "",
                )
                self.make_graph, self.failed = None, True
                for _ in range(n - WARMUP_STEPS):
                    step(a)
                continue
            self.captured += 1
            previous = graph
            for _ in range(n - WARMUP_STEPS):
                graph.replay()
                self.replays += 1

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """Warm-up steps run on a side stream before a CUDA capture (PyTorch's CUDA graph notes)."""
        if self.device.type != "cuda":
            yield
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(stream)
