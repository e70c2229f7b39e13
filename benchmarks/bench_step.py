"""Benchmark the captured spec-decode step: RecoverSSM vs the native snapshot vs the folded commit.

A stack of realistic-width layers (:class:`ssm_spec.graphs.stack.DecoderStack`: hidden 2048, 8 layers
repeating GDN x3 + attention, GDN H=16, HV=32, K=V=128, attention 16/2 heads of 128 over a
static KV buffer with SDPA, dense SwiGLU MLP 5632, vocab 32768, bf16 weights, fp32 state)
decodes under :class:`ssm_spec.graphs.SpecDecodeGraphRunner` (one CUDA graph per batch bucket: every
layer's verify, greedy acceptance, the commit) at each concurrency ``B`` and draft count ``k``,
in five pool modes over the same weights:

* ``recoverssm``: verify from the read-only checkpoint, record, commit the accepted tokens;
* ``snapshot``: the native per-draft path (a state write per window token, a copy at commit);
* ``folded``: RecoverSSM with the commit folded into the next step's verify;
* ``fast``: fast mode (docs/design.md section 2.6): the closed-form verify, folded
  (``StatePool(mode="fast", folded=True)``: a state write at every step with accepted tokens);
* ``lazy``: fast mode with the lazy commit (``max_pending=16``: a state write every few steps).

One fixed acceptance pattern for all of them: the model's logits get a large bonus on chosen
tokens (:class:`PatternForced`), so row ``b`` of step ``s`` accepts exactly ``a[s, b]`` drafts,
drawn once (seeded) with a per-draft acceptance rate ``--alpha``; every mode runs the same
steps, so they do the same work. It reports the median step time (GPU, synchronised over
``--steps`` replays), tokens per second (``B * mean(a + 1) / step time``), and each mode's step
time relative to the snapshot.

Positions stay put between steps (``num_computed_tokens`` is fixed, so the KV buffer never
overflows); the states advance every step as in decoding.

Results (JSON and plot) go to ``benchmarks/out/`` (git-ignored) unless asked otherwise: ``--save``
writes ``benchmarks/results/``, the committed GPU runs (refused for a CPU or ``--quick`` smoke
run), ``--out-dir DIR`` writes DIR. The output's first lines say where.

Usage::

    python benchmarks/bench_step.py --save                  # H200: B 1 4 16 64 256, k 1 3 5, committed
    python benchmarks/bench_step.py --quick --device cpu    # smoke test of the script
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _results import HelpFormatter, add_out_args, device_name, pyplot, resolve_out_dir, slug, write_results
from timing import Clock

from ssm_spec.graphs import SpecDecodeGraphRunner
from ssm_spec.graphs.stack import REALISTIC_WIDTHS, TINY_WIDTHS, DecoderStack
from ssm_spec import StatePool

MODES = ("recoverssm", "snapshot", "folded", "fast", "lazy")
#: StatePool arguments of each mode
POOL_MODES = {"recoverssm": {}, "snapshot": dict(snapshot=True), "folded": dict(folded=True),
              "fast": dict(mode="fast", folded=True), "lazy": dict(mode="fast", folded=True, max_pending=16)}


class PatternForced(torch.nn.Module):
    """``model``'s logits plus ``bonus`` on ``forced[t]`` for every token ``t`` (a static
    buffer the benchmark fills per step), so greedy acceptance follows a chosen pattern."""

    def __init__(self, model, max_tokens: int, device, bonus: float = 1e4):
        super().__init__()
        self.model, self.bonus = model, bonus
        self.register_buffer("forced", torch.zeros(max_tokens, dtype=torch.int64, device=device), persistent=False)

    def forward(self, input_ids, metadata, pool):
        logits = self.model(input_ids, metadata, pool)
        forced = self.forced[: logits.shape[0]]
        return logits.scatter_add(1, forced[:, None], torch.full_like(forced[:, None], self.bonus, dtype=logits.dtype))


def pattern(steps: int, batch: int, k: int, alpha: float, seed: int) -> torch.Tensor:
    """``[steps, batch]`` accepted drafts: each draft passes with probability ``alpha`` until
    the first rejection (the usual acceptance model)."""
    gen = torch.Generator().manual_seed(seed)
    passed = torch.rand(steps, batch, k, generator=gen) < alpha
    return passed.to(torch.int64).cumprod(-1).sum(-1)


def forced_tokens(window: torch.Tensor, accepted: torch.Tensor, vocab: int) -> torch.Tensor:
    """The target token per window position that makes row ``b`` accept ``accepted[b]``
    drafts: the next draft where it should pass, a different token where it should fail."""
    B, W = window.shape
    nxt = torch.cat([window[:, 1:], window[:, :1]], dim=1)
    j = torch.arange(W, device=window.device)[None, :]
    keep = j < accepted[:, None]
    return torch.where(keep, nxt, (nxt + 1) % vocab).reshape(-1)


@torch.no_grad()
def time_mode(stack, model: PatternForced, mode: str, k: int, acc: torch.Tensor, args, tick) -> list[dict]:
    """Capture the step of ``model`` (``stack`` under :class:`PatternForced`) with a fresh pool
    of ``mode`` (:data:`POOL_MODES`) and draft count ``k``, then time ``args.steps`` replays
    (after ``args.warmup``) at each concurrency in ``args.batches``, row ``b`` of step ``s``
    accepting ``acc[s, b]`` drafts (``acc``: ``[steps + warmup, max batch]`` int64, from
    :func:`pattern`). Returns one row per batch: ``step_ms`` (median, ms), ``tokens_per_step``,
    ``tokens_per_s``, ``capture_s`` (s), ``timing`` (``cuda-graph`` or ``eager``).

    Raises:
        AssertionError: the step did not accept what the pattern forces (checked once per batch).
    """
    dev = model.forced.device
    V = stack.lm_head.out_features
    bmax, W = max(args.batches), k + 1
    pool = StatePool(stack.recurrent_layers(), num_slots=bmax, max_tokens=bmax * W, device=dev,
                     dtype=getattr(torch, args.state_dtype), max_window=W, **POOL_MODES[mode])
    gen = torch.Generator().manual_seed(args.seed)
    for state, _ in pool.gdn_groups.values():  # a live state, the same for every mode
        state[:, :bmax].copy_(torch.randn(state[:, :bmax].shape, generator=gen) * 0.05)
    runner = SpecDecodeGraphRunner(model, pool, k, V, buckets=args.batches)
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    rows = []
    for B in args.batches:
        window = torch.randint(0, V, (B, W), generator=gen).to(dev)
        lens = torch.full((B,), W, dtype=torch.int32, device=dev)
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        nct = torch.full((B,), args.prompt_len, dtype=torch.int32, device=dev)
        times, counts = [], []
        for s in range(args.warmup + args.steps):
            a = acc[s, :B].to(dev)
            model.forced[: B * W].copy_(forced_tokens(window, a, V))
            t_start = tick()
            _, n = runner.step(window, lens, slots, nct, validate=False)
            t_end = tick()
            if s >= args.warmup:
                times.append(t_end - t_start)
                counts.append(n.sum().item())
            if s == args.warmup:  # the pattern holds (checked once, outside the timing)
                assert torch.equal(n.cpu().long(), acc[s, :B] + 1), (mode, k, B)
        ms = 1e3 * statistics.median(times)
        rows.append({"k": k, "W": W, "batch": B, "mode": mode, "step_ms": ms,
                     "tokens_per_step": statistics.mean(counts),
                     "tokens_per_s": statistics.mean(counts) / (ms / 1e3),
                     "capture_s": capture_s, "timing": "cuda-graph" if runner.graphs else "eager"})
        print(f"k={k} B={B:4d} {mode:<11} {ms:8.3f} ms/step  {rows[-1]['tokens_per_s']:10.1f} tok/s", flush=True)
    del runner, pool
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def time_stack(args, dev: torch.device, tp_group=None, before_mode=None) -> tuple[dict, list[dict]]:
    """Build the stack (``TINY_WIDTHS`` with ``--quick``, else ``REALISTIC_WIDTHS``; sharded over
    ``tp_group`` when given) and time every ``(k, mode)`` with :func:`time_mode`, calling
    ``before_mode()`` before each (a barrier across ranks). Returns ``(widths, rows)``."""
    widths = TINY_WIDTHS if args.quick else REALISTIC_WIDTHS
    bmax, wmax = max(args.batches), max(args.k) + 1
    stack = DecoderStack(**widths, max_len=args.prompt_len + 2 * wmax, num_slots=bmax, device=dev,
                         dtype=getattr(torch, args.dtype), tp_group=tp_group)
    stack.randomize(0).eval()
    model = PatternForced(stack, bmax * wmax, dev)
    tick = Clock(dev)
    rows = []
    for k in args.k:
        acc = pattern(args.steps + args.warmup, bmax, k, args.alpha, args.seed)
        for mode in args.modes:
            if before_mode is not None:
                before_mode()
            rows += time_mode(stack, model, mode, k, acc, args, tick)
    return widths, rows


def step_config(args, widths: dict) -> dict:
    """The results' ``config``: the widths and the step's arguments."""
    return {**widths, "dtype": args.dtype, "state_dtype": args.state_dtype, "batches": args.batches,
            "k": args.k, "alpha": args.alpha, "steps": args.steps, "warmup": args.warmup,
            "prompt_len": args.prompt_len, "modes": args.modes, "quick": args.quick}


def run(args) -> dict:
    dev = torch.device(args.device)
    widths, rows = time_stack(args, dev)
    for r in rows:
        base = next((x for x in rows if x["k"] == r["k"] and x["batch"] == r["batch"] and x["mode"] == "snapshot"),
                    None)
        r["over_snapshot"] = r["step_ms"] / base["step_ms"] if base else None
    return {
        "device": device_name(dev),
        "torch": torch.__version__,
        "config": step_config(args, widths),
        "rows": rows,
    }


def print_table(res: dict) -> None:
    modes = res["config"]["modes"]
    print(f"\n{res['device']}  torch {res['torch']}  state {res['config']['state_dtype']}, "
          f"alpha {res['config']['alpha']}")
    head = f"{'k':>2} {'B':>4} | " + " ".join(f"{m + ' ms':>14}" for m in modes) + " | " + \
        " ".join(f"{m + '/snap':>15}" for m in modes if m != "snapshot") + " | tok/s (" + modes[0] + ")"
    print(head)
    print("-" * len(head))
    for k in res["config"]["k"]:
        for B in res["config"]["batches"]:
            cell = {r["mode"]: r for r in res["rows"] if r["k"] == k and r["batch"] == B}
            ratios = " ".join(f"{cell[m]['over_snapshot']:15.2f}" if cell[m]["over_snapshot"] else f"{'-':>15}"
                              for m in modes if m != "snapshot")
            print(f"{k:2d} {B:4d} | " + " ".join(f"{cell[m]['step_ms']:14.3f}" for m in modes) + f" | {ratios} | "
                  f"{cell[modes[0]]['tokens_per_s']:.0f}")


def save_plot(res: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    ks = res["config"]["k"]
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.8), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for mode in res["config"]["modes"]:
            pts = [(r["batch"], r["over_snapshot"]) for r in res["rows"] if r["k"] == k and r["mode"] == mode]
            if mode != "snapshot" and all(y is not None for _, y in pts):
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="concurrency (batch)", ylabel="step time / snapshot", title=f"k = {k}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['device']}: captured spec-decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def add_step_args(p: argparse.ArgumentParser, *, batches_help: str, k_default, k_help: str, modes) -> None:
    """The step's arguments this benchmark and ``bench_step_tp.py`` share: ``--batches``, ``--k``,
    ``--modes`` (default ``modes``), ``--alpha``, ``--steps``, ``--warmup``, ``--prompt-len``,
    ``--dtype``, ``--state-dtype``, ``--seed``."""
    p.add_argument("--batches", type=ints, default=None, help=batches_help)
    p.add_argument("--k", type=ints, default=k_default, help=k_help)
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(modes), help="pool modes to compare")
    p.add_argument("--alpha", type=float, default=0.7, help="per-draft acceptance rate of the fixed pattern")
    p.add_argument("--steps", type=int, default=None, help="timed steps per cell (default 30; quick: 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per cell")
    p.add_argument("--prompt-len", type=int, default=64, help="positions already in the KV buffer")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32", help="recurrent state")
    p.add_argument("--seed", type=int, default=0)


def finish_step_args(p: argparse.ArgumentParser, args: argparse.Namespace, *, batches, k, modes) -> None:
    """Fill the step's defaults (``batches`` / ``k``: ``(full, quick)``) and check the values:
    any CPU device (``cpu``, ``cpu:0``, ...) makes a ``--quick`` smoke run; concurrencies, draft
    counts and ``--steps`` >= 1, ``--warmup`` and ``--prompt-len`` >= 0, ``--alpha`` in
    ``[0, 1]``, ``--modes`` among ``modes``. A bad value is a usage error (exit status 2)."""
    try:
        cpu = torch.device(args.device).type == "cpu"
    except RuntimeError as exc:
        p.error(f"--device {args.device}: {exc}")
    args.quick = args.quick or cpu
    pick = 1 if args.quick else 0
    args.batches = args.batches if args.batches is not None else batches[pick]
    args.k = args.k if args.k is not None else k[pick]
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 30)
    if not args.batches or min(args.batches) < 1 or not args.k or min(args.k) < 1:
        p.error("--batches and --k take one or more integers >= 1")
    if args.steps < 1 or args.warmup < 0 or args.prompt_len < 0:
        p.error("--steps must be >= 1, --warmup and --prompt-len >= 0")
    if not 0.0 <= args.alpha <= 1.0:
        p.error(f"--alpha {args.alpha}: an acceptance rate, in [0, 1]")
    bad = [m for m in args.modes if m not in modes]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {modes}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny widths, few steps (a smoke run; on CPU by default)")
    add_step_args(p, batches_help="concurrencies (default 1,4,16,64,256; quick: 1,4)", k_default=None,
                  k_help="draft counts (default 1,3,5; quick: 1,3)", modes=MODES)
    add_out_args(p)
    args = p.parse_args(argv)
    finish_step_args(p, args, batches=([1, 4, 16, 64, 256], [1, 4]), k=([1, 3, 5], [1, 3]), modes=MODES)
    resolve_out_dir(p, args, smoke=args.quick)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    stem = "bench_step_" + ("quick" if args.quick else slug(res["device"])) + f"_{args.state_dtype}"
    write_results(res, args.out_dir, stem, save_plot)
    return res


if __name__ == "__main__":
    main()
