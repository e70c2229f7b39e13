"""Benchmark the GDN ops against the device's copy bandwidth.

One run measures, for every batch size B (B rows, each a uniform window of W = k + 1 tokens):

* the device-to-device copy bandwidth (a large ``dst.copy_(src)``, bytes = read + write):
  the ceiling every other number is compared to;
* ``torch.ops.ssm_spec.gdn_verify``: the RecoverSSM verify (reads the checkpoint, writes the
  layer output and the fp32 replay record, no state written);
* ``torch.ops.ssm_spec.gdn_commit`` with every token accepted (n = W) and with n = 1, in place
  (dst = src);
* ``torch.ops.ssm_spec.gdn_snapshot_verify``: the native path, writing the state after each
  of the W tokens into its own slot;

and reports median times, the bytes each op must move (``BYTES_MODEL``), the achieved
bandwidth as a fraction of the copy bandwidth, and the ratios
``(verify + commit) / snapshot`` for n = W and n = 1.

The ops are called through their ``torch.ops`` forms with preallocated buffers, so no
allocation or host-side value validation is timed. State pages are kept out of the L2 cache:
the pool holds at least ``--pool-gib`` GiB and ``--min-sets`` times what the largest batch
touches, and successive calls rotate over disjoint index sets (plus ``do_bench`` flushes L2
before every timed call). On CUDA, by default (``--timing graph``), each measurement captures
a CUDA graph of up to ``--graph-calls`` calls over distinct index sets and times its replay
with ``triton.testing.do_bench`` (median), dividing by the number of calls: this removes the
Python launch overhead of small batches, as in the engine's full-graph decode step.
``--timing eager`` times single eager calls instead.

``--device cpu`` is a smoke test of this script only (tiny sizes, ``time.perf_counter``).

Usage::

    python benchmarks/bench_ops.py                          # H200, fp32 state
    python benchmarks/bench_ops.py --state-dtype bfloat16
    python benchmarks/bench_ops.py --device cpu             # smoke test of the script
"""

from __future__ import annotations

import argparse
import itertools
import math
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import HelpFormatter, write_results

import ssm_spec  # noqa: F401  (registers torch.ops.ssm_spec.*)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNELS = ("verify", "commit_nW", "commit_n1", "snapshot")
GIB = 1 << 30

#: Minimum bytes each op must move (DRAM traffic of an ideal kernel), per layer and step.
#: Unique bytes are counted once (a key head shared by several value heads is read once);
#: the index/metadata tensors (a few bytes per row) are left out.
BYTES_MODEL = {
    "notation": "B rows, W = k + 1 tokens per row, T = B * W; es = state element size, "
                "ea = activation element size (q, k, v, beta, out); records and g are fp32",
    "slot": "HV * K * V * es  (one state slot)",
    "act_in": "T * ((2*H*K + HV*V) * ea + HV * 4 + HV * ea)  (q, k, v; g fp32; beta)",
    "out": "T * HV * V * ea",
    "record_per_token": "(HV*V + H*K + HV) * 4  (u, k_hat, decay; fp32)",
    "verify": "B * slot + act_in + out + T * record_per_token  (read checkpoint; write out "
              "and the record)",
    "commit(n)": "2 * B * slot + B * n * record_per_token  (read src, write dst; read n "
                 "records per row)",
    "snapshot": "B * slot + T * slot + act_in + out  (read src; write W slots per row; "
                "write out)",
    "copy": "2 * nbytes  (read + write)",
}


# ----------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class Shape:
    H: int
    HV: int
    K: int
    V: int
    W: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        return self.HV * self.K * self.V * self.state_dtype.itemsize

    def bytes_moved(self, B: int) -> dict[str, int]:
        """``BYTES_MODEL`` evaluated for ``B`` rows of ``W`` tokens."""
        H, HV, K, V, W = self.H, self.HV, self.K, self.V, self.W
        ea = self.act_dtype.itemsize
        T = B * W
        slot = self.slot_bytes
        act_in = T * ((2 * H * K + HV * V) * ea + HV * 4 + HV * ea)
        out = T * HV * V * ea
        rec_tok = (HV * V + H * K + HV) * 4
        return {
            "verify": B * slot + act_in + out + T * rec_tok,
            "commit_nW": 2 * B * slot + B * W * rec_tok,
            "commit_n1": 2 * B * slot + B * 1 * rec_tok,
            "snapshot": B * slot + T * slot + act_in + out,
        }


def aligned_rows(values: torch.Tensor) -> list[torch.Tensor]:
    """The rows of ``values [n, m]`` as views that each start on a 16-byte boundary, so every
    index set gets the same Triton pointer-alignment specialization (no recompiles)."""
    n, m = values.shape
    padded = torch.full((n, -(-m // 4) * 4), -1, dtype=values.dtype, device=values.device)
    padded[:, :m] = values
    return [padded[i, :m] for i in range(n)]


class BatchWorkload:
    """Buffers and the four op calls for one batch size.

    Index set ``i`` owns the slot block ``[i * B * (W + 1), (i + 1) * B * (W + 1))`` of the
    pool: its first ``B`` slots are the rows' sources (checkpoints), the next ``T = B * W``
    the snapshot slots of token ``t`` (never any row's source). Activations, outputs and
    records come in ``n_act`` copies; call ``i`` uses set ``i`` and copy ``i % n_act``.
    """

    def __init__(self, shape: Shape, pool: torch.Tensor, B: int, n_sets: int, n_act: int):
        H, HV, K, V, W = shape.H, shape.HV, shape.K, shape.V, shape.W
        dev, act = pool.device, shape.act_dtype
        T = B * W
        self.pool, self.n_sets, self.scale = pool, n_sets, K**-0.5
        i32 = dict(dtype=torch.int32, device=dev)

        # q | k | v as strided views of one conv output [T, 2*H*K + HV*V].
        conv = torch.randn(n_act, T, 2 * H * K + HV * V, dtype=act, device=dev)
        q = conv[..., : H * K].unflatten(-1, (H, K))
        k = conv[..., H * K : 2 * H * K].unflatten(-1, (H, K))
        v = conv[..., 2 * H * K :].unflatten(-1, (HV, V))
        g = -F.softplus(torch.randn(n_act, T, HV, dtype=torch.float32, device=dev))
        beta = torch.sigmoid(torch.randn(n_act, T, HV, dtype=torch.float32, device=dev)).to(act)
        out = torch.empty(n_act, T, HV, V, dtype=act, device=dev)
        rec_u = torch.empty(n_act, T, HV, V, dtype=torch.float32, device=dev)
        rec_k = torch.empty(n_act, T, H, K, dtype=torch.float32, device=dev)
        rec_d = torch.empty(n_act, T, HV, dtype=torch.float32, device=dev)
        self.window = [(q[j], k[j], v[j], g[j], beta[j]) for j in range(n_act)]
        self.out = list(out.unbind(0))
        self.record = list(zip(rec_u.unbind(0), rec_k.unbind(0), rec_d.unbind(0)))
        self._keep = (conv, g, beta, out, rec_u, rec_k, rec_d)

        self.qsl = torch.arange(B + 1, **i32) * W
        base = torch.arange(n_sets, **i32)[:, None] * (B * (W + 1))
        self.src = aligned_rows(base + torch.arange(B, **i32))           # [B] per set
        self.snap = aligned_rows(base + B + torch.arange(T, **i32))      # [T] per set
        self.n_all = torch.full((B,), W, **i32)
        self.n_one = torch.ones(B, **i32)
        self.no_bnd = torch.empty(B, 0, **i32)
        self.n_act = n_act

        # Real records for the commits: one verify per activation copy (also compiles).
        for j in range(n_act):
            self.verify(j)

    def verify(self, i: int) -> None:
        j = i % self.n_act
        torch.ops.ssm_spec.gdn_verify(*self.window[j], self.pool, self.src[i], self.qsl,
                                      self.out[j], *self.record[j], self.scale, True)

    def commit(self, i: int, n: torch.Tensor) -> None:
        src = self.src[i]
        torch.ops.ssm_spec.gdn_commit(self.pool, *self.record[i % self.n_act], self.qsl, src, n,
                                      src, self.no_bnd, self.no_bnd)

    def snapshot(self, i: int) -> None:
        j = i % self.n_act
        torch.ops.ssm_spec.gdn_snapshot_verify(*self.window[j], self.pool, self.src[i], self.qsl,
                                               self.snap[i], self.out[j], self.scale, True)

    def calls(self) -> dict:
        return {
            "verify": self.verify,
            "commit_nW": lambda i: self.commit(i, self.n_all),
            "commit_n1": lambda i: self.commit(i, self.n_one),
            "snapshot": self.snapshot,
        }


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median time of one call, in microseconds.

    CUDA: ``triton.testing.do_bench(..., return_mode="median")`` (which also flushes L2 before
    each timed call), either on a CUDA graph of up to ``graph_calls`` calls over distinct index
    sets (``mode="graph"``; time / calls) or on single eager calls rotating over every index
    set (``mode="eager"``). CPU: ``time.perf_counter``, median of ``cpu_reps`` calls.
    """

    def __init__(self, device: torch.device, mode: str, warmup_ms: int, rep_ms: int,
                 graph_calls: int, cpu_reps: int):
        self.device, self.mode = device, mode
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.graph_calls, self.cpu_reps = graph_calls, cpu_reps

    def time_fn(self, fn) -> float:
        """Median microseconds of ``fn()`` (no rotation: used for the copy)."""
        if self.device.type != "cuda":
            fn()
            times = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e6
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") * 1e3

    def time_call(self, call, n_sets: int) -> tuple[float, str]:
        """Median microseconds of ``call(i)`` over rotating index sets, and how it was timed."""
        if self.device.type == "cuda" and self.mode == "graph":
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
        n = max(1, min(n_sets, self.graph_calls))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile) outside the capture
            for i in range(n):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                call(i)
        us = self.time_fn(graph.replay) / n
        del graph
        return us


def copy_bandwidth(timer: Timer, nbytes: int, device: torch.device) -> dict:
    """Device-to-device ``dst.copy_(src)`` of ``nbytes``; bytes moved = read + write."""
    n = nbytes // 4
    src = torch.randn(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = timer.time_fn(lambda: dst.copy_(src))
    moved = 2 * src.nbytes
    return {"bytes": moved, "time_us": us, "gbps": moved / us / 1e3}


# ----------------------------------------------------------------------------- run


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine() or 'unknown'}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def tile_config(shape: Shape):
    try:
        from ssm_spec.ops.gdn.inner import gdn_tile_config
    except ImportError:
        return None
    return list(gdn_tile_config(shape.K, shape.V))


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    shape = Shape(args.heads, args.value_heads, args.head_k, args.head_v, args.k + 1,
                  DTYPES[args.state_dtype], DTYPES[args.act_dtype])
    W = shape.W
    timer = Timer(device, args.timing, args.warmup_ms, args.rep_ms, args.graph_calls,
                  args.cpu_reps)

    copy = copy_bandwidth(timer, int(args.copy_gib * GIB), device)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # The pool: >= pool_gib, and >= min_sets disjoint index sets of the largest batch.
    max_b = max(args.batches)
    num_slots = max(math.ceil(args.pool_gib * GIB / shape.slot_bytes),
                    args.min_sets * max_b * (W + 1))
    pool = torch.randn(num_slots, shape.HV, shape.K, shape.V, dtype=shape.state_dtype,
                       device=device)

    rows = []
    for B in args.batches:
        n_sets = num_slots // (B * (W + 1))
        work = BatchWorkload(shape, pool, B, n_sets, n_act=min(n_sets, args.act_copies))
        moved = shape.bytes_moved(B)
        kernels = {}
        for name, call in work.calls().items():
            us, how = timer.time_call(call, n_sets)
            gbps = moved[name] / us / 1e3
            kernels[name] = {"time_us": us, "bytes": moved[name], "gbps": gbps,
                             "frac_copy_bw": gbps / copy["gbps"], "timing": how}
        t = {name: kernels[name]["time_us"] for name in KERNELS}
        rows.append({
            "batch": B,
            "tokens": B * W,
            "index_sets": n_sets,
            "kernels": kernels,
            "verify+commit_nW_us": t["verify"] + t["commit_nW"],
            "verify+commit_n1_us": t["verify"] + t["commit_n1"],
            "ratio_vcW_over_snapshot": (t["verify"] + t["commit_nW"]) / t["snapshot"],
            "ratio_vc1_over_snapshot": (t["verify"] + t["commit_n1"]) / t["snapshot"],
            "bytes_ratio_vcW_over_snapshot":
                (moved["verify"] + moved["commit_nW"]) / moved["snapshot"],
            "bytes_ratio_vc1_over_snapshot":
                (moved["verify"] + moved["commit_n1"]) / moved["snapshot"],
        })
        del work
        if device.type == "cuda":
            torch.cuda.synchronize()

    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "sm_count": getattr(props, "multi_processor_count", None),
        "timing": args.timing if device.type == "cuda" else "perf_counter",
        "config": {
            "k": args.k, "W": W, "H": shape.H, "HV": shape.HV, "K": shape.K, "V": shape.V,
            "state_dtype": args.state_dtype, "act_dtype": args.act_dtype,
            "tile_config_BK_BV_warps": tile_config(shape),
            "pool_slots": num_slots, "slot_bytes": shape.slot_bytes,
            "pool_bytes": num_slots * shape.slot_bytes,
            "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "graph_calls": args.graph_calls, "act_copies": args.act_copies,
        },
        "copy_bandwidth_gbps": copy["gbps"],
        "copy": copy,
        "bytes_model": BYTES_MODEL,
        "rows": rows,
    }


# ----------------------------------------------------------------------------- output


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"{res['device']}  torch {res['torch']}  triton {res['triton']}  timing {res['timing']}")
    print(f"H={c['H']} HV={c['HV']} K={c['K']} V={c['V']} W={c['W']} state={c['state_dtype']} "
          f"act={c['act_dtype']}  slot={c['slot_bytes'] / 2**20:.3g} MiB  "
          f"pool={c['pool_bytes'] / GIB:.3g} GiB")
    print(f"copy bandwidth: {res['copy_bandwidth_gbps']:.1f} GB/s "
          f"({res['copy']['bytes'] / GIB:.3g} GiB moved in {res['copy']['time_us']:.1f} us)")
    print("times: median us per call; %BW: achieved bandwidth (BYTES_MODEL / time) as % of "
          "the copy bandwidth; ratios: (verify + commit) / snapshot, in time and in bytes")
    head = (f"{'B':>5} | {'verify':>9} {'commit_W':>9} {'commit_1':>9} {'snapshot':>9} "
            f"| {'%BW ver':>7} {'cW':>4} {'c1':>4} {'snap':>4} "
            f"| {'(v+cW)/s':>8} {'(v+c1)/s':>8} | {'bytes(v+cW)/s':>13} {'bytes(v+c1)/s':>13}")
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        k = r["kernels"]
        times = " ".join(f"{k[n]['time_us']:9.2f}" for n in KERNELS)
        fr = [f"{100 * k[n]['frac_copy_bw']:.0f}" for n in KERNELS]
        print(f"{r['batch']:>5} | {times} | {fr[0]:>7} {fr[1]:>4} {fr[2]:>4} {fr[3]:>4} "
              f"| {r['ratio_vcW_over_snapshot']:8.3f} {r['ratio_vc1_over_snapshot']:8.3f} "
              f"| {r['bytes_ratio_vcW_over_snapshot']:13.3f} "
              f"{r['bytes_ratio_vc1_over_snapshot']:13.3f}")


def save_plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    rows = res["rows"]
    bs = [r["batch"] for r in rows]
    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [
        ("verify", [r["kernels"]["verify"]["time_us"] for r in rows], "-"),
        ("commit n=W", [r["kernels"]["commit_nW"]["time_us"] for r in rows], "-"),
        ("commit n=1", [r["kernels"]["commit_n1"]["time_us"] for r in rows], ":"),
        ("snapshot (native)", [r["kernels"]["snapshot"]["time_us"] for r in rows], "-"),
        ("verify + commit n=W", [r["verify+commit_nW_us"] for r in rows], "--"),
        ("verify + commit n=1", [r["verify+commit_n1_us"] for r in rows], ":"),
    ]
    for label, ys, style in series:
        ax_t.plot(bs, ys, style, marker="o", label=label)
    ax_t.set(xscale="log", yscale="log", xlabel="batch (rows)", ylabel="median time (us)",
             title="time per layer and step")
    for name, label in [("verify", "verify"), ("commit_nW", "commit n=W"),
                        ("commit_n1", "commit n=1"), ("snapshot", "snapshot")]:
        ax_f.plot(bs, [r["kernels"][name]["frac_copy_bw"] for r in rows], marker="o", label=label)
    ax_f.set(xscale="log", xlabel="batch (rows)", ylabel="fraction of copy bandwidth",
             title=f"copy bandwidth {res['copy_bandwidth_gbps']:.0f} GB/s")
    for ax in (ax_t, ax_f):
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    c = res["config"]
    fig.suptitle(f"{res['device']}: GDN ops, W={c['W']}, HV={c['HV']} K={c['K']} V={c['V']}, "
                 f"{c['state_dtype']} state")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (smoke test only)")
    p.add_argument("--batches", type=ints, default=None,
                   help="comma-separated batch sizes (default 1,...,256; cpu: 1,2)")
    p.add_argument("--k", type=int, default=3, help="draft tokens; window W = k + 1")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the state pool")
    p.add_argument("--act-dtype", choices=list(DTYPES), default="bfloat16",
                   help="dtype of q, k, v, beta and out")
    p.add_argument("--heads", type=int, default=16, help="key heads H")
    p.add_argument("--value-heads", type=int, default=32, help="value heads HV")
    p.add_argument("--head-k", type=int, default=None, help="key head dim K (default 128; cpu: 16)")
    p.add_argument("--head-v", type=int, default=None, help="value head dim V (default 128; cpu: 16)")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="where the JSON and the plot go")
    p.add_argument("--timing", choices=["graph", "eager"], default="graph",
                   help="cuda: time a CUDA graph of several calls, or single eager calls")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warmup")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time")
    p.add_argument("--graph-calls", type=int, default=16,
                   help="calls (distinct index sets) per captured graph")
    p.add_argument("--act-copies", type=int, default=16,
                   help="copies of the activations, outputs and records rotated over")
    p.add_argument("--pool-gib", type=float, default=None,
                   help="minimum state pool size in GiB (default 2; cpu: 0.004)")
    p.add_argument("--min-sets", type=int, default=3,
                   help="disjoint index sets of the largest batch the pool must hold")
    p.add_argument("--copy-gib", type=float, default=None,
                   help="copy buffer size in GiB (default 1; cpu: 0.0625)")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions on cpu")
    args = p.parse_args(argv)

    cpu = torch.device(args.device).type == "cpu"
    defaults = {
        "batches": [1, 2] if cpu else [1, 2, 4, 8, 16, 32, 64, 128, 256],
        "head_k": 16 if cpu else 128,
        "head_v": 16 if cpu else 128,
        "pool_gib": 0.004 if cpu else 2.0,
        "copy_gib": 0.0625 if cpu else 1.0,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.batches or min(args.batches) < 1:
        p.error("--batches: expected positive integers")
    if args.value_heads % args.heads:
        p.error("--value-heads must be a multiple of --heads")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for a smoke test)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    write_results(res, args.out_dir, f"bench_ops_{slug(res['device'])}_{args.state_dtype}", save_plot)
    return res


if __name__ == "__main__":
    main()
