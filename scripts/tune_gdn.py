"""Sweep the GDN tiles (BV, num_warps) of verify, commit and the snapshot, and check bits.

Every GDN kernel's bits are a property of its code, not of its tile (``kdot`` in
ssm_spec/ops/gdn/inner.py states the reduction order), so each kernel takes its own fastest
tile per batch size; there is no autotuner (the kernels mutate state). For each candidate
``(BK = block_k(K), BV, num_warps)`` this measures, at one batch and window, the median time of
verify, commit (n = W) and the snapshot (CUDA graphs over rotating slot sets, L2 flushed:
``benchmarks/timing.Timer``), checks on a small batch that commit lands on the snapshot's
state bit for bit at every count 0..W (commit on the candidate and on the shipped commit tile),
and that outputs, records and snapshot states equal the first candidate's bit for bit (the
cross-tile check), and prints the table and each kernel's fastest tile.

    python scripts/tune_gdn.py                         # H200: B=64, k=3, fp32 state
    python scripts/tune_gdn.py --batch 4 --k 1 --state-dtype bfloat16 --tiles 16:1,32:1
    TRITON_INTERPRET=1 python scripts/tune_gdn.py --device cpu   # smoke test (tiny, CPU)

Results go to ``--out`` as JSON; the winners are written into ``TILES`` in
``ssm_spec/ops/gdn/inner.py`` by hand, with the run that chose them noted in docs/perf-notes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]  # the benchmarks' modules; tests.helpers

from ops_workloads import Shape, aligned_rows  # noqa: E402
from timing import Timer  # noqa: E402

from ssm_spec.ops.gdn.commit import launch_gdn_commit  # noqa: E402
from ssm_spec.ops.gdn.inner import block_k, gdn_tile_config  # noqa: E402
from ssm_spec.ops.gdn.verify import gdn_window_cpu, launch_gdn_window  # noqa: E402
from tests.helpers import rel_err  # noqa: E402


def candidates(K: int, V: int):
    bk = block_k(K)
    for bv in (8, 16, 32, 64, 128):
        if bv > max(8, block_k(V)) or bk * bv > 16384:
            continue
        for warps in (1, 2, 4, 8):
            yield bk, bv, warps


def inputs(shape: Shape, B: int, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H, HV, K, V, W = shape.H, shape.HV, shape.K, shape.V, shape.W
    T = B * W
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    q, k = rnd(T, H, K).to(shape.act_dtype), rnd(T, H, K).to(shape.act_dtype)
    v = rnd(T, HV, V).to(shape.act_dtype)
    g = -torch.nn.functional.softplus(rnd(T, HV))
    beta = torch.sigmoid(rnd(T, HV)).to(shape.act_dtype)
    return q, k, v, g, beta


def identical(shape: Shape, config, device) -> tuple[bool, dict, dict]:
    """Whether commit (every n in 0..W) lands on the snapshot's state after n tokens bit for bit,
    the snapshot on tile ``config`` and commit both on ``config`` and on the shipped
    commit tile (the pair the ops run); verify's errors relative to the CPU twin (float32,
    the reference expressions): the fp32 records ``u`` and ``k̂`` (these see an error of a few
    ulp) and the output (in the activation dtype: bf16 rounding on CUDA); and the tensors
    themselves (output, records, snapshot states) for the cross-tile comparison."""
    B, W = 3, shape.W
    args = inputs(shape, B, device, seed=1)
    T = B * W
    pool = (torch.randn(B + T + 1, shape.HV, shape.K, shape.V, generator=torch.Generator().manual_seed(2)) * 0.5).to(
        device=device, dtype=shape.state_dtype)  # the same pool for every tile (the cross-tile check)
    i32 = dict(dtype=torch.int32, device=device)
    src = torch.arange(B, **i32)
    qsl = torch.arange(B + 1, **i32) * W
    out = torch.empty(T, shape.HV, shape.V, dtype=shape.act_dtype, device=device)
    rec = (torch.empty(T, shape.HV, shape.V, device=device), torch.empty(T, shape.H, shape.K, device=device),
           torch.empty(T, shape.HV, device=device))
    launch_gdn_window(*args, pool, src, qsl, None, out, rec, shape.K**-0.5, True, config=config)
    cpu_out = torch.empty(out.shape, dtype=torch.float32)
    cpu_rec = tuple(torch.empty(r.shape) for r in rec)
    gdn_window_cpu(*(a.cpu().float() for a in args), pool.cpu().float(), src.cpu(), qsl.cpu(), None, cpu_out,
                   cpu_rec, shape.K**-0.5, True)
    errs = {"out_rel_err": rel_err(out.cpu(), cpu_out), "u_rel_err": rel_err(rec[0].cpu(), cpu_rec[0]),
            "k_rel_err": rel_err(rec[1].cpu(), cpu_rec[1])}
    snaps = pool.clone()
    snap_out = out.clone()
    launch_gdn_window(*args, snaps, src, qsl, torch.arange(B, B + T, **i32), snap_out, None, shape.K**-0.5, True,
                      config=config)
    bits = {"out": out, "rec_u": rec[0], "rec_k": rec[1], "rec_decay": rec[2], "snapshot_out": snap_out,
            "snapshot_states": snaps[B:B + T]}
    none = torch.empty(B, 0, **i32)
    shipped = gdn_tile_config(shape.K, shape.V, "commit", shape.state_dtype)
    for commit_tile in (config, shipped):
        for n in range(W + 1):
            work = pool.clone()
            counts = torch.full((B,), n, **i32)
            launch_gdn_commit(work, *rec, qsl, src, counts, src, none, none, config=commit_tile)
            for b in range(B):
                want = snaps[B + b * W + n - 1] if n else pool[b]
                if not torch.equal(work[b], want):
                    return False, errs, bits
    return True, errs, bits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (needs TRITON_INTERPRET=1 set "
                                                    "before Python starts; tiny fixed sizes: B=2, H=2, HV=4)")
    p.add_argument("--batch", type=int, default=64, help="rows timed (cuda)")
    p.add_argument("--k", type=int, default=3, help="drafts per row: window W = k + 1")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32", help="state pool dtype")
    p.add_argument("--heads", type=int, default=16, help="key heads H (cuda)")
    p.add_argument("--value-heads", type=int, default=32, help="value heads HV (cuda)")
    p.add_argument("--head-dim", type=int, default=None, help="K = V (default 128; cpu: 16)")
    p.add_argument("--out", type=Path, default=Path("/tmp/tune_gdn.json"), help="JSON with every row and the winners")
    p.add_argument("--tiles", default=None, help="only these 'BV:warps,...' tiles")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the kernels under the Triton interpreter: "
                "set TRITON_INTERPRET=1 before Python starts")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here (for a smoke test: TRITON_INTERPRET=1 python scripts/tune_gdn.py --device cpu)")
    dim = args.head_dim or (128 if dev.type == "cuda" else 16)
    batch = args.batch if dev.type == "cuda" else 2
    shape = Shape(args.heads if dev.type == "cuda" else 2, args.value_heads if dev.type == "cuda" else 4, dim, dim,
                  args.k + 1, getattr(torch, args.state_dtype), torch.bfloat16 if dev.type == "cuda" else torch.float32)
    timer = Timer(dev, "graph" if dev.type == "cuda" else "eager", 25, 100, 16, 1)
    W, T = shape.W, batch * shape.W
    n_sets = 8 if dev.type == "cuda" else 1
    pool = torch.randn(n_sets * batch * (W + 1), shape.HV, shape.K, shape.V, device=dev).to(shape.state_dtype)
    i32 = dict(dtype=torch.int32, device=dev)
    base = torch.arange(n_sets, **i32)[:, None] * (batch * (W + 1))
    src = aligned_rows(base + torch.arange(batch, **i32))
    snap = aligned_rows(base + batch + torch.arange(T, **i32))
    qsl = torch.arange(batch + 1, **i32) * W
    act = inputs(shape, batch, dev)
    out = torch.empty(T, shape.HV, shape.V, dtype=shape.act_dtype, device=dev)
    rec = (torch.empty(T, shape.HV, shape.V, device=dev), torch.empty(T, shape.H, shape.K, device=dev),
           torch.empty(T, shape.HV, device=dev))
    n_all = torch.full((batch,), W, **i32)
    none = torch.empty(batch, 0, **i32)
    rows = []
    first_bits = None  # the first tile's outputs, records and snapshot states
    tiles = candidates(shape.K, shape.V)
    if args.tiles:
        bk = block_k(shape.K)
        tiles = [(bk, *map(int, t.split(":"))) for t in args.tiles.split(",")]
    for cfg in tiles:
        try:
            ok, errs, bits = identical(shape, cfg, dev)
            if first_bits is None:
                first_bits = (cfg, bits)
            same_as_first = all(torch.equal(bits[name], first_bits[1][name]) for name in bits)
            calls = {
                "verify": lambda i, c=cfg: launch_gdn_window(*act, pool, src[i], qsl, None, out, rec,
                                                             shape.K**-0.5, True, config=c),
                "commit": lambda i, c=cfg: launch_gdn_commit(pool, *rec, qsl, src[i], n_all, src[i], none, none,
                                                             config=c),
                "snapshot": lambda i, c=cfg: launch_gdn_window(*act, pool, src[i], qsl, snap[i], out, None,
                                                               shape.K**-0.5, True, config=c),
            }
            times = {name: timer.time_call(call, n_sets)[0] for name, call in calls.items()}
        except Exception as exc:  # a configuration Triton cannot compile (registers, shared memory)
            print(f"BK={cfg[0]} BV={cfg[1]} warps={cfg[2]}: failed ({type(exc).__name__}: {exc})")
            continue
        row = {"BK": cfg[0], "BV": cfg[1], "num_warps": cfg[2], "identical": ok,
               "bits_equal_first_tile": same_as_first, **errs,
               **{f"{k}_us": v for k, v in times.items()}, "verify+commit_us": times["verify"] + times["commit"]}
        rows.append(row)
        print(f"BK={cfg[0]:4d} BV={cfg[1]:4d} warps={cfg[2]} | verify {times['verify']:9.2f} commit "
              f"{times['commit']:9.2f} snapshot {times['snapshot']:9.2f} us | identical {ok} | = tile 1 {same_as_first} | "
              f"rel err u {errs['u_rel_err']:.1e} "
              f"k {errs['k_rel_err']:.1e} out {errs['out_rel_err']:.1e}",
              flush=True)
    good = [r for r in rows if r["identical"] and r["bits_equal_first_tile"]]
    best = min(good, key=lambda r: r["verify_us"]) if good else None
    best_commit = min(good, key=lambda r: r["commit_us"]) if good else None
    best_snap = min(good, key=lambda r: r["snapshot_us"]) if good else None
    for name, row in (("verify", best), ("commit", best_commit), ("snapshot", best_snap)):
        if row:
            print(f"fastest {name}: BV={row['BV']} warps={row['num_warps']} ({row[name + '_us']:.2f} us)")
    tile_independent = all(r["bits_equal_first_tile"] for r in rows)
    print(f"outputs, records and snapshot states bit-identical across all {len(rows)} tiles: {tile_independent}")
    args.out.write_text(json.dumps({"device": str(dev), "batch": batch, "k": args.k, "state_dtype": args.state_dtype,
                                    "tile_independent": tile_independent,
                                    "H": shape.H, "HV": shape.HV, "K": shape.K, "V": shape.V, "rows": rows,
                                    "best": best, "best_commit": best_commit, "best_snapshot": best_snap},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0 if best and tile_independent else 1


if __name__ == "__main__":
    raise SystemExit(main())
