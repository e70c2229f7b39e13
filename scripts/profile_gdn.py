"""Launch one GDN kernel a few times on the benchmark's workload, for ``ncu`` to read.

``bench_ops.py`` times the ops; this runs a chosen one (``--kernel verify|commit|snapshot|
folded|native_engine|closed_form_verify|closed_form_folded|lazy|lazy_fold``; ``lazy``: 12 tokens
pending under ``max_pending = 16``, the history path; ``lazy_fold``: 15 pending, the folding
step) at one batch, window and state dtype, with an optional tile, so that Nsight Compute can
read its hardware counters (issue, FMA pipe, memory throughput, occupancy, stall reasons,
registers, local-memory traffic)::

    ncu --clock-control none -k regex:gdn_window_kernel -c 1 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python scripts/profile_gdn.py --kernel verify

``scripts/gpu_check.sh ncu`` runs it over the kernels and writes the reports under ``$OUT``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from ops_workloads import DTYPES, BatchWorkload, Shape  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default="verify",
                   choices=["verify", "commit", "snapshot", "folded", "native_engine", "closed_form_verify",
                            "closed_form_folded", "lazy", "lazy_fold"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tile", default=None, help="the kernel's tile 'BV:warps' (default: its table's)")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    shape = Shape(16, 32, 128, 128, args.k + 1, DTYPES[args.state_dtype], torch.bfloat16)
    B, W = args.batch, shape.W
    n_sets = 4
    pool = torch.randn(n_sets * B * (W + 1), shape.HV, shape.K, shape.V, device=dev).to(shape.state_dtype)
    if args.tile:  # before the workload's first verify (ncu reads the first launches)
        from ssm_spec.ops.gdn import inner

        bv, warps = map(int, args.tile.split(":"))
        kernel = {"snapshot": "snapshot", "commit": "commit"}.get(args.kernel, "verify")
        if args.kernel.startswith(("closed_form", "lazy")):
            kernel = "closed_form"
        inner.TILES.setdefault((shape.K, shape.V, shape.state_dtype), {})[kernel] = ((None, bv, warps),)
    work = BatchWorkload(shape, pool, B, n_sets, n_act=2)
    call = {"verify": work.verify, "commit": lambda i: work.commit(i, work.n_all), "snapshot": work.snapshot,
            "folded": work.folded, "native_engine": work.native_engine, "closed_form_verify": work.closed_form_verify,
            "closed_form_folded": lambda i: work.lazy_verify(i, "closed_form_folded", work.n_all),
            "lazy": lambda i: work.lazy_verify(i, "lazy", torch.full_like(work.n_all, 12)),
            "lazy_fold": lambda i: work.lazy_verify(i, "lazy", torch.full_like(work.n_all, 15))}[args.kernel]
    for i in range(args.calls):
        call(i % n_sets)
    torch.cuda.synchronize()
    print(f"ran {args.kernel} x{args.calls}: B={B} W={W} state={args.state_dtype} tile={args.tile or 'table'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
