"""Benchmark the captured spec-decode step under tensor parallelism: the realistic-width stack
sharded over the ranks of ``torchrun``.

Every rank builds :class:`ssm_spec.graphs.stack.DecoderStack` at ``REALISTIC_WIDTHS`` (as
``bench_step.py``: hidden 2048, 8 layers, GDN H=16, HV=32, K=V=128, attention 16/2 heads of
128, MLP 5632, vocab 32768, bf16 weights, fp32 state) sharded over the world
(``DecoderStack(..., tp_group=WORLD)``: GDN heads, attention query / KV heads, MLP width; one
all-reduce after each mixer and MLP; embedding, norms and LM head replicated) on
``cuda:$LOCAL_RANK``, and times the step exactly as ``bench_step.py`` does (its
:func:`~bench_step.time_mode`: one CUDA graph per batch bucket holding every layer's verify, the
all-reduces, greedy acceptance and the commit; the same forced acceptance pattern, per-draft
rate ``--alpha``) in the pool modes ``recoverssm`` (exact: verify + commit) and ``folded``, at
concurrency ``--batches`` (default 1, 16, 64, 256) and ``--k`` (default 3). A step's time is
the median over ``--steps`` replays on each rank; the reported ``step_ms`` is the slowest
rank's (``step_ms_ranks`` has each), tokens/s are ``B * mean(a + 1) / step_ms``.

Launch: ``python`` for TP 1 (the unsharded stack, no process group: the same stack and step as
``bench_step.py``), ``torchrun --nproc-per-node N`` for TP N (NCCL on CUDA, gloo on the CPU;
the environment's NCCL variables are kept as they are and recorded in the JSON). Rank 0 prints a
table and writes ``bench_step_tp<N>_<gpu>_<state-dtype>.json`` (``bench_step_tp<N>_quick_...``
for a smoke run). ``--merge DIR [DIR ...]`` (no process group) reads every such JSON in the
folders and draws step time vs concurrency per TP size and mode with the ratios TP-N / TP-1
(``bench_step_tp_<gpu>_<state-dtype>.png``, and the ratios as ``.json``).

``--quick`` (implied by ``--device cpu``) is a smoke run: tiny widths, B 1 and 4, 3 steps
(eager on the CPU, where nothing is captured; captured on CUDA as the full run). Results go to
``benchmarks/out/`` (git-ignored) unless asked otherwise:
``--save`` writes ``benchmarks/results/`` (refused for a smoke run), ``--out-dir DIR`` writes DIR.

Usage::

    python benchmarks/bench_step_tp.py --out-dir OUT                                  # TP 1
    torchrun --nproc-per-node 2 benchmarks/bench_step_tp.py --out-dir OUT             # TP 2 (NCCL)
    python benchmarks/bench_step_tp.py --merge OUT --out-dir OUT                      # the plot
    torchrun --nproc-per-node 2 benchmarks/bench_step_tp.py --quick --device cpu     # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _results import HelpFormatter, add_out_args, device_name, pyplot, resolve_out_dir, slug, write_results
from bench_step import MODES as STEP_MODES
from bench_step import add_step_args, finish_step_args, step_config, time_stack


#: The pool modes timed by default: exact RecoverSSM and the folded commit.
MODES = ("recoverssm", "folded")


def join_group(device: str) -> tuple[torch.device, object, int, int]:
    """``(device, tp_group, rank, world)`` for this process. Without ``torchrun`` (or with one
    process) no group is made: ``(device, None, 0, 1)``. Under ``torchrun`` with several
    processes: NCCL on ``cuda:$LOCAL_RANK`` when ``device`` is a CUDA device, gloo on the CPU;
    the group is the world."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return torch.device(device), None, 0, 1
    if torch.device(device).type == "cuda":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    return dev, dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def leave_group(group) -> None:
    """Leave the process group before the interpreter exits: collect what may still hold it
    (a compiled or captured step's leftover cycles), wait for every rank, then destroy it, which
    joins gloo's worker threads. A group left to the interpreter's exit ended one gloo run in ten
    with ``terminate called without an active exception`` (SIGABRT) after the results were
    written (torch 2.13, CPU): a worker thread released the last collective's tensors during
    finalization (pytorch/pytorch#190489; docs/multi-gpu.md)."""
    if group is None:
        return
    gc.collect()
    dist.barrier(group)
    dist.destroy_process_group()
    gc.collect()


def nccl_environment() -> dict:
    """The ``NCCL_*`` variables as this process found them (never changed here), and NCCL's version."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    try:
        version = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:  # a build without NCCL
        version = None
    return {"nccl_version": version, "nccl_env": env}


def gather_rows(rows: list[dict], group) -> list[dict]:
    """Each row with ``step_ms`` the slowest rank's median (ms), ``step_ms_ranks`` every rank's, and
    ``tokens_per_s`` from it; without a group the rows as they are (``step_ms_ranks`` of one)."""
    per_rank = [rows]
    if group is not None:
        per_rank = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_rank, rows, group=group)
    out = []
    for i, row in enumerate(rows):
        times = [r[i]["step_ms"] for r in per_rank]
        ms = max(times)
        out.append({**row, "step_ms": ms, "step_ms_ranks": times, "tokens_per_s": row["tokens_per_step"] / (ms / 1e3)})
    return out


@torch.no_grad()
def run(args) -> dict:
    dev, group, rank, world = join_group(args.device)
    if rank:  # one table: the other ranks time in silence
        sys.stdout = open(os.devnull, "w")
    widths, rows = time_stack(args, dev, group, (lambda: dist.barrier(group)) if group is not None else None)
    rows = gather_rows(rows, group)
    res = {
        "device": device_name(dev),
        "torch": torch.__version__,
        "tp": world,
        "backend": dist.get_backend(group) if group is not None else None,
        **nccl_environment(),
        "config": step_config(args, widths),
        "rows": rows,
    }
    leave_group(group)
    return res if rank == 0 else None


def print_table(res: dict) -> None:
    modes = res["config"]["modes"]
    print(f"\n{res['device']}  TP {res['tp']}  torch {res['torch']}  state {res['config']['state_dtype']}, "
          f"alpha {res['config']['alpha']}")
    head = f"{'k':>2} {'B':>4} | " + " ".join(f"{m + ' ms':>14}" for m in modes) + " | " + \
        " ".join(f"{m + ' tok/s':>17}" for m in modes)
    print(head)
    print("-" * len(head))
    for k in res["config"]["k"]:
        for B in res["config"]["batches"]:
            cell = {r["mode"]: r for r in res["rows"] if r["k"] == k and r["batch"] == B}
            print(f"{k:2d} {B:4d} | " + " ".join(f"{cell[m]['step_ms']:14.3f}" for m in modes) + " | " +
                  " ".join(f"{cell[m]['tokens_per_s']:17.0f}" for m in modes))


def stem(res: dict) -> str:
    """``bench_step_tp<N>_<gpu or quick>_<state dtype>``."""
    name = "quick" if res["config"]["quick"] else slug(res["device"])
    return f"bench_step_tp{res['tp']}_{name}_{res['config']['state_dtype']}"


# ----------------------------------------------------------------------------- merge


def load_runs(dirs: list[Path]) -> list[dict]:
    """Every ``bench_step_tp<N>_*.json`` in ``dirs``, ordered by TP size.

    Raises:
        ValueError: none found, a file that is not JSON (named), runs that differ in anything
            but the TP size (device or any ``config`` entry: one plot compares one setting), or
            two runs of one TP size.
    """
    runs = []
    for d in dirs:
        for path in sorted(Path(d).glob("bench_step_tp[0-9]*_*.json")):
            try:
                res = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"--merge: {path}: {exc}") from None
            if isinstance(res, dict) and "tp" in res and "rows" in res and isinstance(res.get("config"), dict):
                res["_path"] = str(path)
                runs.append(res)
    if not runs:
        raise ValueError(f"--merge: no bench_step_tp<N>_*.json in {', '.join(map(str, dirs))}")
    first = runs[0]
    for r in runs[1:]:  # one plot compares one setting: everything but the TP size must agree
        diff = sorted(key for key in set(first["config"]) | set(r["config"])
                      if first["config"].get(key) != r["config"].get(key))
        if r["device"] != first["device"]:
            diff.insert(0, "device")
        if diff:
            raise ValueError(f"--merge: {r['_path']} and {first['_path']} differ in {', '.join(diff)}")
    for r in runs:
        del r["_path"]
    sizes = [r["tp"] for r in runs]
    if len(set(sizes)) < len(sizes):
        raise ValueError(f"--merge: several runs of one TP size: {sorted(sizes)}")
    return sorted(runs, key=lambda r: r["tp"])


def merge(runs: list[dict]) -> dict:
    """Step times per TP size, mode, k and batch, and their ratio over TP 1's (``None`` without
    a TP 1 run or where TP 1 lacks that cell)."""
    base = {(r["mode"], r["k"], r["batch"]): r["step_ms"] for run in runs if run["tp"] == 1 for r in run["rows"]}
    rows = []
    for run in runs:
        for r in run["rows"]:
            b = base.get((r["mode"], r["k"], r["batch"]))
            rows.append({"tp": run["tp"], "mode": r["mode"], "k": r["k"], "batch": r["batch"], "step_ms": r["step_ms"],
                         "tokens_per_s": r["tokens_per_s"], "over_tp1": r["step_ms"] / b if b else None})
    first = runs[0]
    return {"device": first["device"], "torch": first["torch"], "tp_sizes": [r["tp"] for r in runs],
            "config": {**first["config"], "merged": True}, "rows": rows}


def save_merged_plot(res: dict, path: Path) -> bool:
    """Per k: step time vs concurrency, a line per TP size and mode (left); TP-N / TP-1 (right)."""
    plt = pyplot()
    if plt is None:
        return False
    ks = sorted({r["k"] for r in res["rows"]})
    fig, axes = plt.subplots(len(ks), 2, figsize=(10, 3.8 * len(ks)), squeeze=False)
    for (ax_t, ax_r), k in zip(axes, ks):
        for c, tp in enumerate(res["tp_sizes"]):
            for i, mode in enumerate(sorted({r["mode"] for r in res["rows"]})):
                pts = sorted((r["batch"], r["step_ms"], r["over_tp1"]) for r in res["rows"]
                             if r["k"] == k and r["tp"] == tp and r["mode"] == mode)
                if not pts:
                    continue
                style = dict(marker="o", color=f"C{c}", ls="-" if i == 0 else "--", label=f"TP {tp} {mode}")
                ax_t.plot([p[0] for p in pts], [p[1] for p in pts], **style)
                if tp != 1 and all(p[2] is not None for p in pts):
                    ax_r.plot([p[0] for p in pts], [p[2] for p in pts], **style)
        ax_t.set(xscale="log", yscale="log", xlabel="concurrency (batch)", ylabel="step time (ms)", title=f"k = {k}")
        ax_r.axhline(1.0, color="gray", lw=0.8)
        ax_r.set(xscale="log", xlabel="concurrency (batch)", ylabel="step time TP-N / TP-1", title=f"k = {k}")
        for ax in (ax_t, ax_r):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{res['device']}: captured spec-decode step, tensor parallel")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_merged(res: dict) -> None:
    print(f"\n{res['device']}: step time (ms) and TP-N / TP-1 per TP size")
    for r in sorted(res["rows"], key=lambda r: (r["k"], r["mode"], r["batch"], r["tp"])):
        ratio = f"{r['over_tp1']:6.2f}" if r["over_tp1"] is not None else "     -"
        print(f"k={r['k']} {r['mode']:<11} B={r['batch']:4d} TP {r['tp']}: {r['step_ms']:9.3f} ms  {ratio}")


# ----------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (rank r on cuda:$LOCAL_RANK, NCCL) or cpu (gloo, implies --quick)")
    p.add_argument("--quick", action="store_true", help="tiny widths, few steps (a smoke run)")
    add_step_args(p, batches_help="concurrencies (default 1,16,64,256; quick: 1,4)", k_default=None,
                  k_help="draft counts (default 3)", modes=MODES)
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="DIR",
                   help="draw the runs' JSON in DIR ... into one plot instead of running (no process group)")
    add_out_args(p)
    args = p.parse_args(argv)
    if args.merge is not None:
        try:
            args.runs = load_runs(args.merge)
        except ValueError as exc:
            p.error(str(exc))
        resolve_out_dir(p, args, smoke=args.runs[0]["config"]["quick"])
        return args
    finish_step_args(p, args, batches=([1, 16, 64, 256], [1, 4]), k=([3], [3]), modes=STEP_MODES)
    resolve_out_dir(p, args, smoke=args.quick)
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.merge is not None:
        res = merge(args.runs)
        print_merged(res)
        name = "quick" if res["config"]["quick"] else slug(res["device"])
        write_results(res, args.out_dir, f"bench_step_tp_{name}_{res['config']['state_dtype']}", save_merged_plot)
        return res
    res = run(args)
    if res is not None:  # rank 0
        print_table(res)
        write_results(res, args.out_dir, stem(res), lambda res, path: False)  # one plot: --merge draws it
    return res


if __name__ == "__main__":
    main()
