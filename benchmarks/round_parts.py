"""A decode-loop round's device time, part by part.

:func:`round_parts` runs a ``generate`` call with its rounds eager (the same code a captured
round replays, compiled pieces included) and profiles a few of them with ``torch.profiler``.
Each part of the round runs between two device synchronisations inside a
``record_function`` range, so every kernel it launches starts and ends within that range's
host interval; a kernel is counted in the innermost range that holds its start. Parts:

- ``draft``: the drafter's ``propose`` (its scores and argmax included), and inside it
  ``draft: head`` (the MTP head's layer applications) or ``draft: assistant`` (the
  assistant's forwards, their cache steps included);
- ``verify``: the target's verify forward with its cache step and metadata;
- ``accept``: the round's scores and acceptance (greedy, matching or rejection; a plain round's
  argmax or draw);
- ``append``: the accepted tokens into each row, lengths and finished flags;
- ``commit``: the target's RecoverSSM commit;
- ``drafter update``: the drafter's own ``accept`` (an assistant's commit, the MTP head's pass
  over the window), and inside it ``drafter update: head``;
- ``counters``: the acceptance counters;
- ``other``: what the round does outside those (window columns, the last token).

The sums are kernel durations only: what a captured replay adds between kernels is the replay's
time (CUDA events, ``loop_round_cost.py``) minus their total. Off CUDA the same ranges sum the
profiler's CPU operators instead of kernels (a smoke run; no timing meaning).
"""

from __future__ import annotations

import statistics
import time
import types

import torch

__all__ = ["round_parts", "PARTS"]

#: The parts in the order a round runs them (nested ones after their parent).
PARTS = ("draft", "draft: head", "draft: assistant", "verify", "accept", "append", "commit", "drafter update",
         "drafter update: head", "counters", "other")
#: Ranges inside a part, reported as ``"<part>: <name>"``.
_SUBPARTS = ("head", "assistant")
_ACCEPT = ("accept_greedy", "accept_matching", "accept_rejection")


def _ranged(fn, name: str, device: torch.device):
    """``fn`` run between two synchronisations inside ``record_function(name)``."""
    def wrapper(*args, **kwargs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with torch.profiler.record_function(name):
            out = fn(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return out
    return wrapper


def _patch(loop, device):
    """Wrap the round's parts (instance attributes and the runner's acceptance functions);
    returns a function that undoes it."""
    from ssm_spec.hf.loop import runner

    undo = []

    def wrap(obj, attr, name):
        original = getattr(obj, attr)
        owned = isinstance(obj, types.ModuleType) or attr in vars(obj)  # else a method of its class
        setattr(obj, attr, _ranged(original, name, device))
        undo.append((lambda: setattr(obj, attr, original)) if owned else (lambda: delattr(obj, attr)))

    d = loop.drafter
    if d is not None:
        # sub-parts: named after the part whose range holds them (_attribute)
        if hasattr(d, "_apply_in_round"):  # the MTP head's applications, in propose and in accept
            wrap(d, "_apply_in_round", "head")
        if hasattr(d, "model") and hasattr(d.model, "verify"):  # an assistant's LoopModel
            wrap(d.model, "verify", "assistant")
        wrap(d, "propose", "draft")
        if hasattr(d, "accept"):
            wrap(d, "accept", "drafter update")
    wrap(loop.target, "verify", "verify")
    wrap(loop.target, "commit", "commit")
    wrap(loop.rows, "append", "append")
    wrap(loop, "_count", "counters")
    wrap(loop, "scoring", "accept")
    wrap(loop, "_choose", "accept")  # a plain round's next token
    for name in _ACCEPT:
        wrap(runner, name, "accept")

    def restore():
        for u in reversed(undo):
            u()
    return restore


def _attribute(prof, device) -> dict:
    """``{part: (count, ms)}`` of one profiled round (module docstring)."""
    events = list(prof.events())
    names = {*PARTS, *_SUBPARTS, "round"}
    ranges = [e for e in events if e.name in names]
    if device.type == "cuda":
        # kernels, copies and fills (not the ranges' own device-side annotations)
        work = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                and not getattr(e, "is_user_annotation", False) and e.name not in names]
    else:  # top-level operators: those with no operator parent
        work = [e for e in events if e.name.startswith("aten::") and
                (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    out = {}
    for w in work:
        start = w.time_range.start
        holders = [r for r in ranges if r.time_range.start <= start <= r.time_range.end]
        if not holders:
            continue
        holders.sort(key=lambda r: r.time_range.end - r.time_range.start)  # innermost first
        inner = holders[0]
        part = "other" if inner.name == "round" else inner.name
        if inner.name in _SUBPARTS:
            part = f"{next(r.name for r in holders if r.name not in _SUBPARTS)}: {inner.name}"
        n, ms = out.get(part, (0, 0.0))
        out[part] = (n + 1, ms + w.time_range.elapsed_us() / 1e3)
    return out


class _Eager:
    """Stands in for a loop's captured graph: a replay runs its rounds eagerly."""

    def __init__(self, loop):
        self.loop = loop

    def replay(self):
        self.loop._rounds()


def round_parts(model, ids: torch.Tensor, kw: dict, new: int, rounds: int = 3, skip: int = 2) -> dict:
    """Profile round batches ``skip .. skip + rounds - 1`` (``loop.per_graph`` rounds each: 4
    for plain decoding, 1 with a drafter) of one ``generate(ids, max_new_tokens=new, **kw)`` call
    (greedy unless ``kw`` says ``do_sample``) on a converted model whose decode loop for that
    very call already exists: a warm-up call with the same ``ids``, ``kw`` and ``new`` made it.
    Its rounds run eagerly for this call; then its graph and replay count are put back.

    Returns ``{"parts": {part: {"kernels": per round, "ms": per round (median over the
    batches)}}, "kernels": total per round, "ms": total per round, "rounds": profiled rounds,
    "sequences": the call's output, "wall_s": the call's seconds}``; off CUDA the counts and ms
    are of CPU operators.

    Raises:
        ValueError: the model has no decode loop yet, the call built another one (its ``kw`` or
            ``new`` differ from the warm-up's), or it ran fewer than ``skip + 1`` round batches.
    """
    runtime = getattr(model, "_recoverssm", None)
    loop = getattr(runtime, "loop", None)
    if loop is None:
        raise ValueError("round_parts: the model has no decode loop yet: make the same generate call once first")
    device = loop.rows.device
    # the loop replays ``loop.graph`` when it has one and captures when it has none: a stand-in
    # whose replay runs the rounds eagerly keeps it from capturing again
    graph, replays = loop.graph, loop.replays
    loop.graph = _Eager(loop) if graph is not None else None
    seen, profiles = [0], []

    def rounds_fn():
        i = seen[0]
        seen[0] += 1
        if not skip <= i < skip + rounds:
            return type(loop)._rounds(loop)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(device)
        restore = _patch(loop, device)
        try:
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(loop.per_graph):
                    with torch.profiler.record_function("round"):
                        loop._round()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        finally:
            restore()
        profiles.append(_attribute(prof, device))

    loop._rounds = rounds_fn
    t = time.perf_counter()
    try:
        with torch.no_grad():
            sequences = model.generate(ids, max_new_tokens=new, **{"do_sample": False, **kw})
    finally:
        del loop._rounds
        loop.graph, loop.replays = graph, replays
    if runtime.loop is not loop:
        raise ValueError("round_parts: the call built another decode loop (its kw or max_new_tokens differ from "
                         "the warm-up call's, or its prompt needs more columns): nothing was profiled")
    if not profiles:
        raise ValueError(f"round_parts: the call ran {seen[0]} round batches, fewer than skip + 1 = {skip + 1}")
    per = loop.per_graph
    parts = {}
    for name in PARTS:
        got = [p.get(name, (0, 0.0)) for p in profiles]
        if any(n for n, _ in got):
            parts[name] = {"kernels": statistics.median(n for n, _ in got) / per,
                           "ms": statistics.median(ms for _, ms in got) / per}
    return {"parts": parts, "kernels": sum(p["kernels"] for p in parts.values()),
            "ms": sum(p["ms"] for p in parts.values()), "rounds": len(profiles) * per,
            "sequences": sequences, "wall_s": time.perf_counter() - t}
