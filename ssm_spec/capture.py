"""Strict CUDA-graph capture: one memory pool, host syncs as errors, no allocation outside the pool.

Every capture in ssm_spec goes through :class:`GraphCapture`: the uniform step of
``ssm_spec.graphs`` (:class:`~ssm_spec.graphs.SpecDecodeGraphRunner`), the Hugging Face path's
graphed forwards (:mod:`ssm_spec.hf.graphed`) and the decode loop's rounds. A graph must hold
the whole step or not exist: a host read inside it would replay stale values, and memory taken
outside the graph pool would be reused by the allocator while the graph still writes it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings

import torch

__all__ = ["CaptureError", "GraphCapture", "collection_paused", "host_syncs_raise"]


class CaptureError(RuntimeError):
    """A step cannot be held by a CUDA graph: it synchronised with the host, ran an operation
    capture forbids, or allocated memory outside the graph pool while being captured."""


def _where(exc: BaseException, depth: int = 3) -> str:
    """`` (at file:line in function: code <- its caller ...)``: the innermost ``depth`` frames of
    ``exc``'s traceback outside torch, the call that synchronised or failed first (empty when
    there is none)."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename.replace("\\", "/") and not f.filename.endswith("capture.py")]
    if not frames:
        return ""
    return " (at " + " <- ".join(f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()[:100]}"
                                 for f in reversed(frames[-depth:])) + ")"


@contextlib.contextmanager
def host_syncs_raise():
    """Inside the block a host synchronisation (``.item()``, ``.tolist()``, a device-to-host
    copy, ``nonzero``) raises ``RuntimeError`` instead of passing (``torch.cuda``'s sync debug
    mode ``"error"``, without its "prototype feature" warning); the mode is restored after."""
    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode(mode)


_pause_lock = threading.Lock()
_pauses = 0  # blocks inside collection_paused, over all threads
_enabled_before = False  # whether collection was on when the first of them began


@contextlib.contextmanager
def collection_paused():
    """Python's automatic garbage collection off inside the block; on again when the last such
    block of any thread ends, if it was on before the first (``gc`` is per process; an explicit
    ``gc.collect()`` still runs). A collection inside a capture can free a CUDA graph that sits
    in a reference cycle (a dropped cache and the forward that captured on it), and destroying a
    graph while the stream captures is an operation capture forbids: the capture is invalidated
    ("operation not permitted when stream is capturing (function reset)", then
    ``cudaErrorStreamCaptureInvalidated`` at its end). ``torch.cuda.graph`` collects on entry
    only under ``torch.compiler.config.force_cudagraph_gc`` (off by default), and a collection can
    still start inside the capture. The garbage waits for the next collection outside one."""
    global _pauses, _enabled_before
    with _pause_lock:
        if _pauses == 0:
            _enabled_before = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _enabled_before:
                gc.enable()


def _release_generators(generator) -> str:
    """After a capture that failed: end the capture mode of the CUDA generators it registered
    (the current device's default one and ``generator``) by capturing an empty graph with the
    same generators. A capture registers them as it begins and releases them at its end, after
    ``cudaStreamEndCapture``; when that call fails (an invalidated capture),
    ``CUDAGraph.capture_end`` raises before the release, and with torch 2.12 and older (one
    capture flag on the generator's state) every later draw outside a capture, and every replay
    of a graph captured earlier that draws, then fails ("Offset increment outside graph capture
    encountered unexpectedly", seen on the H200 with torch 2.11 when inductor timed a padded GEMM
    after a failed capture). The empty capture sets and clears that flag on the same state
    object, so the random stream stays one; with torch 2.13 (states kept per capture) it is
    harmless. Returns ``""``, or what went wrong with it (never raised: the capture's own error
    is the one to report)."""
    try:
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "the CUDA graph is empty"
            with torch.cuda.graph(graph):
                pass
        return ""
    except RuntimeError as exc:
        return f" (releasing the random generators after it failed too: {exc})"


def _active_blocks_outside(pool_id) -> dict[int, int]:
    """``{address: size}`` of the caching allocator's allocated blocks that are not in ``pool_id``."""
    blocks = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) == tuple(pool_id):
            continue
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                blocks[blk["address"]] = blk["size"]
    return blocks


class GraphCapture:
    """Captures CUDA graphs of one device into one shared memory pool, strictly.

    Args:
        device: the CUDA device the graphs run on.
        name: who captures (prefixes every :class:`CaptureError` message).

    Attributes:
        mempool: the graph memory pool handle every graph shares (``None`` until the first
            capture, and after :meth:`reset`).
    """

    def __init__(self, device, name: str):
        self.device = torch.device(device)
        self.name = name
        self.mempool = None

    def reset(self) -> None:
        """Forget the memory pool (call it when every graph captured into it is dropped: capturing
        into the handle of a pool the allocator has freed trips an internal assert)."""
        self.mempool = None

    def warmup(self, fn, iters: int = 1, what: str = "the step") -> None:
        """Run ``fn()`` ``iters`` times on a side stream with host syncs as errors (kernels compile
        and libraries set up their workspaces outside any graph), then wait for it.

        Raises:
            CaptureError: ``fn`` synchronised with the host or failed on the device (the error is
                chained); other exceptions of ``fn`` pass through unchanged.
        """
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream), host_syncs_raise():
                for _ in range(iters):
                    fn()
        except RuntimeError as exc:  # torch.AcceleratorError (CUDA errors) derives from it
            torch.cuda.synchronize(self.device)
            raise CaptureError(f"{self.name}: warming up {what}: it synchronised with the host or failed on the "
                               f"device: {exc}{_where(exc)}") from exc
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capture(self, fn, what: str = "the step", generator: torch.Generator | None = None):
        """Capture ``fn()`` into a new graph in the shared pool; returns ``(graph, fn's result)``.

        Host syncs raise while ``fn`` runs, and any block allocated outside the pool by ``fn``
        (memory on another stream, say) refuses the graph. Automatic garbage collection is off
        while the stream captures (a collected graph would end the capture). ``generator`` (a
        CUDA generator) is registered with the graph, so each replay draws fresh numbers.

        Raises:
            CaptureError: a host sync, an operation CUDA graphs forbid (the error is chained), or
                allocations outside the pool (their count and bytes given).
        """
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        try:
            # thread_local: only this thread's unsafe calls end the capture; in "global" mode a
            # call of another thread of the process (inductor's compile workers, once anything
            # was compiled) can invalidate it
            with collection_paused(), torch.cuda.graph(graph, pool=self.mempool,
                                                        capture_error_mode="thread_local"):
                # read the allocator around fn alone: entering the capture may itself allocate outside
                # the pool once per process (the graph-safe RNG's seed and offset tensors)
                before = _active_blocks_outside(self.mempool)
                with host_syncs_raise():
                    result = fn()
                after = _active_blocks_outside(self.mempool)
        except RuntimeError as exc:
            after_failure = ""
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as sync_exc:  # a sticky device error: the capture's error stays the one raised
                after_failure = f" (synchronising after it failed too: {sync_exc})"
            after_failure += _release_generators(generator)
            raise CaptureError(f"{self.name}: capturing {what}: it synchronised with the host or ran an operation "
                               f"CUDA graphs cannot hold: {exc}{_where(exc)}{after_failure}") from exc
        new = {a: s for a, s in after.items() if a not in before}
        if new:
            raise CaptureError(f"{self.name}: capturing {what}: it allocated {len(new)} block(s), "
                               f"{sum(new.values())} bytes, outside the graph memory pool")
        return graph, result
