"""Small-batch projections at a model's widths: cuBLAS against inductor's GEMV, in GB/s.

A decode step at batch 1 is a chain of GEMMs of one row (four to six in a verify window): each
reads its weight once, so its time over the weight's bytes is the bandwidth it reaches. For every
projection shape of the 3.6 B Qwen3.5 width (separate and fused, ``ssm_spec.hf.fused_linear``)
and each row count ``M`` this times

- ``cublas``: ``F.linear`` (what eager PyTorch and inductor's default ``mm`` lowering call);
- ``inductor_gemv``: ``torch.compile`` of the product written as a broadcast multiply and a sum
  over the input dimension (inductor emits one Triton reduction kernel: a GEMV);
- ``max_autotune`` (``--autotune``): ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")``,
  inductor choosing among cuBLAS and its Triton GEMM templates by timing them;
- ``triton_splitk``: the split-K Triton GEMV of ``splitk_gemv.py``, the fastest of its
  ``CONFIGS`` for each shape and ``M`` (its tile and split count recorded; not for the LM head,
  whose cuBLAS GEMV already runs at the copy bandwidth).

Each is timed as a CUDA graph of ``--calls`` calls cycling over enough copies of the weight
that none is read from L2 twice (so launch gaps are the graph's, as in a captured decode step);
the table gives microseconds per call and GB/s (weight bytes over time) beside the device's
copy bandwidth measured in the same run.

    python benchmarks/bench_gemv.py --out-dir /tmp/gemv     # CUDA only
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import HelpFormatter, add_out_args, device_name, pyplot, resolve_out_dir, slug, write_results  # noqa: E402
from forward_timing import copy_bandwidth  # noqa: E402
from splitk_gemv import MAX_ROWS, best_config, graph_us, splitk_gemv  # noqa: E402

#: The split-K candidate is swept for weights up to this many bytes (not the LM head's 1.3 GB).
SPLITK_MAX_BYTES = 256e6

#: (name, out_features, in_features) at the 3.6 B Qwen3.5 width of bench_hf_generate.py
#: (hidden 2560, GDN 16 key / 32 value heads of 128, attention 16 / 4 heads of 256, MLP 9216).
SHAPES = (
    ("gdn in_proj_qkv", 8192, 2560),
    ("gdn in_proj_z", 4096, 2560),
    ("gdn in_proj_b (a)", 32, 2560),
    ("gdn fused in_proj", 8192 + 4096 + 64, 2560),
    ("gdn out_proj", 2560, 4096),
    ("attn q_proj (+gate)", 8192, 2560),
    ("attn k_proj (v)", 1024, 2560),
    ("attn fused qkv", 8192 + 2048, 2560),
    ("attn o_proj", 2560, 4096),
    ("mlp gate_proj (up)", 9216, 2560),
    ("mlp fused gate_up", 2 * 9216, 2560),
    ("mlp down_proj", 2560, 9216),
    ("lm_head", 248320, 2560),
)


def _gemv(x, w):
    return (x[:, None, :].float() * w[None].float()).sum(-1).to(x.dtype)


def run(args) -> dict:
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device)
    torch._dynamo.config.recompile_limit = 4 * len(SHAPES) * len(args.rows)  # one graph per shape and M, all compiled
    backends = {"cublas": F.linear, "inductor_gemv": torch.compile(_gemv, dynamic=False)}
    if args.autotune:
        backends["max_autotune"] = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    rows = []
    for name, n, k in SHAPES:
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, math.ceil(args.cold_bytes / nbytes))
        ws = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in args.rows:
            xs = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(2)]
            ref = F.linear(xs[0].double(), ws[0].double())
            entry = {"shape": name, "out_features": n, "in_features": k, "rows": m, "weight_bytes": nbytes}
            for backend, fn in backends.items():
                if backend == "max_autotune" and m not in args.autotune_rows:
                    continue
                err = ((fn(xs[0], ws[0]).double() - ref).norm() / ref.norm()).item()
                us = graph_us(fn, xs, ws, args.calls, args.reps)
                entry[backend] = {"us": us, "GBps": nbytes / us / 1e3, "of_copy_bandwidth": nbytes / us / 1e3 / (bandwidth / 1e9),
                                  "rel_err": err}
            if nbytes <= SPLITK_MAX_BYTES and m <= MAX_ROWS:
                found = best_config(xs, ws, args.calls, max(3, args.reps // 2))
                if found is not None:
                    us, config = found
                    y = splitk_gemv(xs[0], ws[0], **config)
                    entry["triton_splitk"] = {"us": us, "GBps": nbytes / us / 1e3,
                                              "of_copy_bandwidth": nbytes / us / 1e3 / (bandwidth / 1e9),
                                              "rel_err": ((y.double() - ref).norm() / ref.norm()).item(),
                                              "config": config}
            best = min((b for b in (*backends, "triton_splitk") if b in entry), key=lambda b: entry[b]["us"])
            entry["fastest"] = best
            rows.append(entry)
            print(f"{name:22s} M={m}: " + "  ".join(f"{b} {entry[b]['us']:7.2f} us {entry[b]['GBps']:6.0f} GB/s"
                                                      for b in (*backends, "triton_splitk") if b in entry), flush=True)
        del ws
    return {"device": torch.cuda.get_device_name(device), "dtype": args.dtype, "torch": torch.__version__,
            "copy_bandwidth_GBps": bandwidth / 1e9, "calls_per_graph": args.calls, "rows": rows,
            "backends": [*backends, "triton_splitk"]}


def print_table(res: dict) -> None:
    backends = res["backends"]
    print(f"\n{res['device']}, {res['dtype']}, copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s "
          f"(us per call, GB/s, share of copy bandwidth)")
    print(f"{'shape':22s} {'N x K':>12s} {'M':>2s} | " + " | ".join(f"{b:>26s}" for b in backends) + " | fastest")
    for r in res["rows"]:
        cells = []
        for b in backends:
            e = r.get(b)
            cells.append(f"{e['us']:8.2f} {e['GBps']:6.0f} ({e['of_copy_bandwidth']:4.2f})" if e else f"{'-':>26s}")
        print(f"{r['shape']:22s} {r['out_features']:>6d}x{r['in_features']:<5d} {r['rows']:>2d} | "
              + " | ".join(f"{c:>26s}" for c in cells) + f" | {r['fastest']}")


def save_plot(res: dict, path: Path) -> None:
    plt = pyplot()
    rows = [r for r in res["rows"] if r["rows"] == 1]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(res["backends"])
    for i, b in enumerate(res["backends"]):
        ax.bar([j + i * width for j in range(len(rows))], [r[b]["GBps"] if b in r else 0 for r in rows], width,
               label=b)
    ax.axhline(res["copy_bandwidth_GBps"], color="k", ls="--", lw=1, label="copy bandwidth")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["shape"] for r in rows], rotation=35,
                  ha="right", fontsize=8)
    ax.set_ylabel("GB/s (weight bytes / time)")
    ax.set_title(f"one-row projections, {res['device']}, {res['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6], help="rows per GEMM (M)")
    p.add_argument("--calls", type=int, default=64, help="calls captured per graph")
    p.add_argument("--reps", type=int, default=10, help="graph replays timed, median")
    p.add_argument("--cold-bytes", type=float, default=256e6,
                   help="weight copies cycled per shape: at least this many bytes (L2 is 50 MB on an H200)")
    p.add_argument("--autotune", action="store_true", help="also inductor's max-autotune GEMM (slow to compile)")
    p.add_argument("--autotune-rows", type=int, nargs="+", default=[1], help="row counts the autotuned GEMM runs at")
    add_out_args(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("CUDA only: the GEMMs are timed in CUDA graphs")
    resolve_out_dir(p, args, smoke=False)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    write_results(res, args.out_dir, f"gemv_{slug(device_name(torch.device('cuda')))}_{args.dtype}", save_plot)
    return res


if __name__ == "__main__":
    main()
