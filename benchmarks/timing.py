"""How the benchmarks time: one clock, the phases of a run, the spread of timed calls, and the
median of an op's calls (``do_bench`` and CUDA graphs on CUDA, the clock on the CPU)."""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import sys
import time


class Clock:
    """``time.perf_counter`` with a device synchronisation before each reading (seconds)."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Phases:
    """Wall time of the named phases of a run (``with phases("name"): ...``), synchronised."""

    def __init__(self, clock):
        self.clock, self.seconds = clock, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = self.clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self.clock() - t0


#: Timed calls of one run that differ by more than this factor (slowest / fastest) are reported:
#: a short warm-up can leave compilation in the first timed call, which a median of two then
#: averages in (the H200 case is in docs/perf-notes.md, "Warm-up").
TIMING_SPREAD_LIMIT = 1.3


def timing_spread(name: str, times) -> float:
    """``max(times) / min(times)`` of one run's timed calls (seconds); prints a warning to stderr
    naming the run when it exceeds :data:`TIMING_SPREAD_LIMIT`. Raises ``ValueError`` on an empty
    list or a time that is not a positive, finite number."""
    times = list(times)
    if not times or not all(t > 0 and math.isfinite(t) for t in times):
        raise ValueError(f"{name}: timed calls must be a non-empty list of positive, finite seconds, got {times}")
    spread = max(times) / min(times)
    if spread > TIMING_SPREAD_LIMIT:
        print(f"warning: {name}: timed calls differ {spread:.2f}x ({', '.join(f'{t:.3f}' for t in times)} s): "
              "work the warm-up left undone (compilation, autotuning) or a busy machine; raise "
              "--warmup-tokens or --repeats", file=sys.stderr)
    return spread


class Timer:
    """Median time of one call, in microseconds.

    CUDA: ``triton.testing.do_bench(..., return_mode="median")`` (which also flushes L2 before
    each timed call), either on a CUDA graph of up to ``graph_calls`` calls over distinct index
    sets (``mode="graph"``; time / calls) or on single eager calls rotating over every index
    set (``mode="eager"``). CPU: :class:`Clock`, median of ``cpu_reps`` calls.
    """

    def __init__(self, device, mode: str, warmup_ms: int, rep_ms: int, graph_calls: int, cpu_reps: int):
        self.clock = Clock(device)
        self.device, self.mode = self.clock.device, mode
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.graph_calls, self.cpu_reps = graph_calls, cpu_reps

    def time_fn(self, fn) -> float:
        """Median microseconds of ``fn()`` (no rotation: used for the copy and the FMAs)."""
        if self.device.type != "cuda":
            fn()
            times = []
            for _ in range(self.cpu_reps):
                t0 = self.clock()
                fn()
                times.append(self.clock() - t0)
            return statistics.median(times) * 1e6
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") * 1e3

    def time_call(self, call, n_sets: int) -> tuple[float, str]:
        """Median microseconds of ``call(i)`` over rotating index sets, and how it was timed."""
        if self.device.type == "cuda" and self.mode == "graph":
            import torch

            try:
                return self._graph(call, n_sets), "cuda-graph"
            except Exception as exc:  # keep the run going on an unexpected capture failure
                torch.cuda.synchronize()
                print(f"warning: CUDA graph capture failed ({exc!r}); timing eagerly",
                      file=sys.stderr)
        counter = itertools.count()
        us = self.time_fn(lambda: call(next(counter) % n_sets))
        return us, ("eager" if self.device.type == "cuda" else "perf_counter")

    def _graph(self, call, n_sets: int) -> float:
        import torch

        n = max(1, min(n_sets, self.graph_calls))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile) outside the capture
            for i in range(n):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        from ssm_spec.capture import collection_paused

        graph = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(graph):  # a graph collected inside would end the capture
            for i in range(n):
                call(i)
        us = self.time_fn(graph.replay) / n
        del graph
        return us
