"""Benchmark the GDN ops against the device's copy bandwidth and fp32 FMA rate.

One run measures two ceilings:

* the device-to-device copy bandwidth (a large ``dst.copy_(src)``, bytes = read + write);
* the fp32 FMA rate (a plain kernel running independent chains of FMAs on a large tensor:
  Triton on CUDA, ``torch.addcmul`` on CPU), in fp32 ops/s (one FMA = one op = 2 FLOPs);

and, for every draft length k in ``--k`` (window W = k + 1) and every batch size B (B rows,
each a uniform window of W tokens):

* ``torch.ops.ssm_spec.gdn_verify``: the RecoverSSM verify (reads the checkpoint, writes the
  layer output and the fp32 replay record, no state written);
* ``torch.ops.ssm_spec.gdn_commit`` with every token accepted (n = W) and with n = 1, in place
  (dst = src);
* ``torch.ops.ssm_spec.gdn_snapshot_verify``: the native path, writing the state after each
  of the W tokens into its own slot, on its own tile table (bits do not depend on tiles);
* ``native_engine``: the native spec-decode kernel engines ship (``native_engine.py``: one
  program per 8-wide V slice and (row, value head), one warp, every token's state into its own
  slot), the second baseline;
* ``torch.ops.ssm_spec.gdn_folded_verify``: the previous window (W tokens, all accepted) folded
  into the checkpoint, stored once, then this window verified; its records and the previous
  ones are different copies (double-buffered);
* an outside peer, fla-core's ``fused_recurrent_gated_delta_rule`` (CUDA only, imported
  lazily, skipped with a note when missing) over the same B rows x W tokens from the same
  states, writing the output and an fp32 final state: ``fla`` gathers the rows' states by
  index (``index_select``, timed; or passes ``ssm_state_indices`` where the installed version
  takes them) and ``fla_contig`` hands it the rows' slots as one contiguous block (its kernel
  alone);

and reports median times, the bytes each op must move (``BYTES_MODEL``) and the fp32 ops it
must do (``OPS_MODEL``), the fraction of its roofline floor ``max(bytes / copy bandwidth,
ops / FMA rate) / time``, the achieved bandwidth as a fraction of the copy bandwidth, and the
ratios ``(verify + commit) / snapshot`` (n = W and n = 1) and ``folded / snapshot``.

The ops are called through their ``torch.ops`` forms with preallocated buffers, so no
allocation or host-side value validation is timed. State pages are kept out of the L2 cache:
the pool holds at least ``--pool-gib`` GiB and ``--min-sets`` times what the largest batch
(at the largest W) touches, and successive calls rotate over disjoint index sets (plus
``do_bench`` flushes L2 before every timed call). On CUDA, by default (``--timing graph``),
each measurement captures a CUDA graph of up to ``--graph-calls`` calls over distinct index
sets and times its replay with ``triton.testing.do_bench`` (median), dividing by the number of
calls: this removes the Python launch overhead of small batches, as in the engine's
full-graph decode step. ``--timing eager`` times single eager calls instead.

``--device cpu`` is a smoke test of this script only (tiny sizes, ``time.perf_counter``).

Results (JSON and plot) go to ``benchmarks/out/`` (git-ignored) unless asked otherwise: ``--save``
writes ``benchmarks/results/``, the committed GPU runs (refused for a CPU or ``--quick`` smoke
run), ``--out-dir DIR`` writes DIR. The output's first lines say where.

Usage::

    python benchmarks/bench_ops.py --save                   # H200, fp32 state, k = 1,2,3,5,7, committed
    python benchmarks/bench_ops.py --state-dtype bfloat16
    python benchmarks/bench_ops.py --k 3 --batches 1,16,256
    python benchmarks/bench_ops.py --device cpu             # smoke test of the script
    python benchmarks/bench_ops.py --replot benchmarks/results/bench_ops_nvidia-h200_float32.json  # redraw
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
from _results import HelpFormatter, add_out_args, device_name, resolve_out_dir, slug, write_results
from ops_report import batch_row, print_table, save_plot
from ops_workloads import DTYPES, LAZY_MAX_PENDING, BatchWorkload, Shape, tile_config
from peers import PeerCalls, check_peer, load_peer
from roofline import (BYTES_MODEL, GIB, OPS_MODEL, bytes_moved, copy_bandwidth, fma_rate, kernel_stats, op_counts,
                      ring_memory, triton)
from timing import Timer


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    shapes = [Shape(args.heads, args.value_heads, args.head_k, args.head_v, k + 1,
                    DTYPES[args.state_dtype], DTYPES[args.act_dtype]) for k in args.k]
    shape0 = shapes[0]
    timer = Timer(device, args.timing, args.warmup_ms, args.rep_ms, args.graph_calls,
                  args.cpu_reps)

    copy = copy_bandwidth(timer, int(args.copy_gib * GIB), device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fma = fma_rate(timer, int(args.fma_mib * 2**20), args.fma_iters, device)
    peer, peer_note = load_peer(device, not args.no_peer)
    print(f"note: {peer_note}")

    # The pool: >= pool_gib, and >= min_sets disjoint index sets of the largest batch at the
    # largest window.
    max_b, max_w = max(args.batches), max(s.W for s in shapes)
    num_slots = max(math.ceil(args.pool_gib * GIB / shape0.slot_bytes),
                    args.min_sets * max_b * (max_w + 1))
    pool = torch.randn(num_slots, shape0.HV, shape0.K, shape0.V, dtype=shape0.state_dtype,
                       device=device)

    rows = []
    for k, shape in zip(args.k, shapes):
        W = shape.W
        for B in args.batches:
            n_sets = num_slots // (B * (W + 1))
            work = BatchWorkload(shape, pool, B, n_sets, n_act=min(n_sets, args.act_copies))
            peer_calls, peer_err = (PeerCalls(work, peer) if peer is not None else None), None
            if peer_calls is not None:
                peer, peer_note, peer_err = check_peer(peer_calls, peer_note)
                if peer is None:
                    peer_calls = None
            moved = bytes_moved(shape, B, peer.mode if peer is not None else None)
            ops = op_counts(shape, B)
            calls = work.calls()
            if peer_calls is not None:
                calls.update(peer_calls.calls())
            kernels = {}
            for name, call in calls.items():
                us, how = timer.time_call(call, n_sets)
                kernels[name] = kernel_stats(us, moved[name], ops[name], copy, fma, how)
            phase_us = {p: timer.time_call(call, n_sets)[0] for p, call in work.lazy_calls().items()}
            kernels["lazy"] = kernel_stats(statistics.mean(phase_us.values()), moved["lazy"], ops["lazy"], copy, fma,
                                           how)
            kernels["lazy"]["phase_us"] = {str(p): us for p, us in phase_us.items()}
            rows.append(batch_row(k, W, B, n_sets, kernels, moved, peer_err))
            del work, peer_calls
            if device.type == "cuda":
                torch.cuda.synchronize()

    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", None),
        "cuda": torch.version.cuda,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "sm_count": getattr(props, "multi_processor_count", None),
        "timing": args.timing if device.type == "cuda" else "perf_counter",
        "config": {
            "k": list(args.k), "W": [s.W for s in shapes], "batches": list(args.batches),
            "H": shape0.H, "HV": shape0.HV, "K": shape0.K, "V": shape0.V,
            "state_dtype": args.state_dtype, "act_dtype": args.act_dtype,
            "tiles_BK_BV_warps": {kernel: {B: tile_config(shape0, kernel, B) for B in args.batches}
                                  for kernel in ("verify", "snapshot", "commit", "closed_form")},
            "lazy_max_pending": LAZY_MAX_PENDING,
            "pool_slots": num_slots, "slot_bytes": shape0.slot_bytes,
            "pool_bytes": num_slots * shape0.slot_bytes,
            "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "graph_calls": args.graph_calls, "act_copies": args.act_copies,
            "fma_mib": args.fma_mib, "fma_iters": args.fma_iters,
        },
        "copy_bandwidth_gbps": copy["gbps"],
        "copy": copy,
        "fma_tops": fma["tops"],
        "fma": fma,
        "record_bytes_per_token": shape0.record_bytes_per_token,
        "record_bytes_per_token_over_state":
            shape0.record_bytes_per_token / (shape0.HV * shape0.K * shape0.V * 4),
        "ring_bytes_per_slot_over_state": ring_memory(shape0, max(s.W for s in shapes)),
        "peer": {"name": "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
                 "available": peer is not None, "mode": getattr(peer, "mode", None),
                 "fla_core_version": getattr(peer, "version", None), "note": peer_note},
        "bytes_model": BYTES_MODEL,
        "ops_model": OPS_MODEL,
        "rows": rows,
    }


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--replot", metavar="RESULT.json", default=None,
                   help="redraw the table and plot of a saved run (no device needed; other options ignored)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (smoke test only)")
    p.add_argument("--batches", type=ints, default=None,
                   help="comma-separated batch sizes (default 1,4,16,32,64,128,256; cpu: 1,2)")
    p.add_argument("--k", type=ints, default=None,
                   help="comma-separated draft lengths; window W = k + 1 (default 1,2,3,5,7; "
                        "cpu: 1,3)")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the state pool")
    p.add_argument("--act-dtype", choices=list(DTYPES), default="bfloat16",
                   help="dtype of q, k, v, beta and out")
    p.add_argument("--heads", type=int, default=16, help="key heads H")
    p.add_argument("--value-heads", type=int, default=32, help="value heads HV")
    p.add_argument("--head-k", type=int, default=None, help="key head dim K (default 128; cpu: 16)")
    p.add_argument("--head-v", type=int, default=None, help="value head dim V (default 128; cpu: 16)")
    add_out_args(p)
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
    p.add_argument("--fma-mib", type=float, default=None,
                   help="fp32 data of the FMA kernel in MiB (default 64; cpu: 1)")
    p.add_argument("--fma-iters", type=int, default=None,
                   help="FMAs per element and chain in the FMA kernel (default 512; cpu: 32)")
    p.add_argument("--no-peer", action="store_true", help="skip the fla-core peer")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions on cpu")
    args = p.parse_args(argv)

    cpu = torch.device(args.device).type == "cpu"
    defaults = {
        "batches": [1, 2] if cpu else [1, 4, 16, 32, 64, 128, 256],
        "k": [1, 3] if cpu else [1, 2, 3, 5, 7],
        "head_k": 16 if cpu else 128,
        "head_v": 16 if cpu else 128,
        "pool_gib": 0.004 if cpu else 2.0,
        "copy_gib": 0.0625 if cpu else 1.0,
        "fma_mib": 1.0 if cpu else 64.0,
        "fma_iters": 32 if cpu else 512,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.batches or min(args.batches) < 1:
        p.error("--batches: expected positive integers")
    if not args.k or min(args.k) < 0:
        p.error("--k: expected non-negative integers")
    if args.fma_iters < 1 or args.fma_mib <= 0:
        p.error("--fma-iters and --fma-mib must be positive")
    if args.value_heads % args.heads:
        p.error("--value-heads must be a multiple of --heads")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for a smoke test)")
    resolve_out_dir(p, args, smoke=cpu)
    return args


def main(argv=None) -> dict:
    if argv is None:
        argv = sys.argv[1:]
    if "--replot" in argv:  # redraw a saved run: --replot RESULT.json (no device needed)
        i = argv.index("--replot")
        if i + 1 >= len(argv):
            raise SystemExit("usage: bench_ops.py --replot RESULT.json")
        path = Path(argv[i + 1])
        res = json.loads(path.read_text())
        print_table(res)
        save_plot(res, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
        return res
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    write_results(res, args.out_dir, f"bench_ops_{slug(res['device'])}_{args.state_dtype}", save_plot)
    return res


if __name__ == "__main__":
    main()
