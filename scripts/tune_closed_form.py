"""Sweep the tiles (BV, num_warps) of fast mode's closed-form kernel, and check its bits.

For each batch, window, candidate tile and register cap this times (CUDA graphs over rotating
slot sets, L2 flushed: ``benchmarks/timing.Timer``) the plain closed-form verify, the lazy
verify with 12 tokens pending under ``max_pending = 16`` (history, no fold), the lazy fold with 15
pending under ``max_pending = 16`` (the folding step of a lazy cycle) and the folded form with
``W`` pending under ``max_pending = 1`` (a fold every step); reports each as a fraction of the
copy bandwidth for the bytes it must move, beside the exact verify; and checks that every
variant's outputs, records and folded states equal the first one's bit for bit.

    python scripts/tune_closed_form.py                               # H200: B=64, W=2,4,8, fp32
    python scripts/tune_closed_form.py --batch 1,4,256 --windows 4 --state-dtype bfloat16
    python scripts/tune_closed_form.py --windows 4 --tiles 128:1 --max-registers 128,96 --ring-key-rows 4,8
    python scripts/tune_closed_form.py --windows 2,4 --tiles 128:1 --stages 1,2
    python scripts/tune_closed_form.py --windows 2,4,8 --tiles 128:1 --prefetch 0,1 --plain-key-rows 2,4,8
    TRITON_INTERPRET=1 python scripts/tune_closed_form.py --device cpu   # smoke test (tiny)

The winners go into ``TILES`` (kernel ``"closed_form"``) in ``ssm_spec/ops/gdn/inner.py`` by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from ops_workloads import Shape, aligned_rows  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402
from timing import Timer  # noqa: E402

from ssm_spec.ops.gdn.closed_form import MAX_REGISTERS, RecordRing, launch_closed_form, ring_positions  # noqa: E402
from ssm_spec.ops.gdn.inner import block_k, gdn_tile_config  # noqa: E402
from ssm_spec.ops.gdn.verify import launch_gdn_window  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=ints, default=None, help="rows (default 64; cpu: 2)")
    p.add_argument("--windows", type=ints, default=[2, 4, 8])
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tiles", default="8:1,16:1,32:1,32:2,64:2,64:4", help="BV:num_warps,...")
    p.add_argument("--max-registers", type=ints, default=None,
                   help="register caps to sweep per tile (maxnreg; default: the kernel's MAX_REGISTERS)")
    p.add_argument("--ring-key-rows", type=ints, default=None,
                   help="the ring forms' state-loop rows per chunk to sweep (KC; default: the launch's)")
    p.add_argument("--plain-key-rows", type=ints, default=None,
                   help="the plain form's state-loop rows per chunk to sweep (KC; default the launch's)")
    p.add_argument("--stages", type=ints, default=None,
                   help="the state loop's num_stages to sweep (STAGES; default the launch's)")
    p.add_argument("--prefetch", type=ints, default=None,
                   help="0/1: the state loop loads each chunk a chunk ahead, to sweep (PREFETCH; default the launch's)")
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    if any(w < 1 or w > 16 for w in args.windows):
        p.error(f"--windows: got {args.windows}; expected window lengths in 1..16")
    if args.prefetch and any(x not in (0, 1) for x in args.prefetch):
        p.error(f"--prefetch: got {args.prefetch}; expected 0 and/or 1")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the Triton kernels under the interpreter: set TRITON_INTERPRET=1 before the "
                "command (TRITON_INTERPRET=1 python scripts/tune_closed_form.py --device cpu)")
    return args


def main(argv=None):
    args = parse(argv)
    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    H, HV, K, V = (2, 4, 16, 16) if cpu else (16, 32, 128, 128)
    sdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.state_dtype]
    timer = Timer(dev, "graph", 25, 100, 16, 1)
    copy = copy_bandwidth(timer, (1 << 20) if cpu else (2 << 30), dev)
    args.batch = args.batch or ([2] if cpu else [64])
    tiles = [(block_k(K), *map(int, t.split(":"))) for t in args.tiles.split(",")]
    caps = args.max_registers or [MAX_REGISTERS]
    chunks = args.ring_key_rows or [None]
    plain_chunks = args.plain_key_rows or [None]
    depths = args.stages or [None]
    prefetches = [bool(x) for x in args.prefetch] if args.prefetch else [None]
    rows = []
    for B in args.batch:
        for W in args.windows:
            shape = Shape(H, HV, K, V, W, sdt, torch.bfloat16)
            n_sets = 2 if cpu else max(3, min(16, (6 << 30) // (B * shape.slot_bytes)))
            S = n_sets * B
            T = B * W
            gen = torch.Generator().manual_seed(B * 10 + W)
            rnd = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
            act = torch.float32 if cpu else torch.bfloat16
            q, k, v = rnd(T, H, K).to(act), rnd(T, H, K).to(act), rnd(T, HV, V).to(act)
            g = -torch.nn.functional.softplus(rnd(T, HV))
            beta = torch.sigmoid(rnd(T, HV)).to(act)
            pool = (rnd(S, HV, K, V) * 0.5).to(sdt)
            src = aligned_rows(torch.arange(n_sets, dtype=torch.int32, device=dev)[:, None] * B
                               + torch.arange(B, dtype=torch.int32, device=dev))
            qsl = torch.arange(B + 1, dtype=torch.int32, device=dev) * W
            out = torch.empty(T, HV, V, dtype=act, device=dev)
            rec = (torch.empty(T, HV, V, device=dev), torch.empty(T, H, K, device=dev), torch.empty(T, HV, device=dev))
            rings = {}
            for L in (1, 16):
                ring = RecordRing.zeros(S, ring_positions(L, W), H, HV, K, V, dev)
                ring.u.normal_(generator=None)
                ring.k.normal_()
                ring.k.div_(ring.k.norm(dim=-1, keepdim=True))
                ring.g.normal_().abs_().neg_()
                rings[L] = ring
            zeros = torch.zeros(B, dtype=torch.int32, device=dev)
            p_hist = torch.full_like(zeros, min(12, 16 - W))
            p_fold = torch.full_like(zeros, W)
            p_lfold = torch.full_like(zeros, 15)  # 15 + W > 16 for W >= 2: the lazy cycle's folding step
            scale = K**-0.5
            slot_b = B * shape.slot_bytes
            act_b = T * ((2 * H * K + HV * V) * 2 + HV * 4 + HV * 2) + T * HV * V * 2
            rec_b = T * shape.record_bytes_per_token
            need = {"plain": slot_b + act_b + rec_b,
                    "lazy_hist": slot_b + act_b + rec_b + B * int(p_hist[0]) * shape.record_bytes_per_token,
                    "lazy_fold": 2 * slot_b + act_b + rec_b + B * 15 * shape.record_bytes_per_token,
                    "folded": 2 * slot_b + act_b + rec_b + B * W * shape.record_bytes_per_token}

            def calls(tile, cap, kc, pkc, st, pf):
                return {
                    "plain": lambda i: launch_closed_form(q, k, v, g, beta, pool, src[i], qsl, out, rec, W, scale,
                                                          True, config=tile, max_registers=cap, key_rows=pkc,
                                                          stages=st, prefetch=pf),
                    "lazy_hist": lambda i: launch_closed_form(q, k, v, g, beta, pool, src[i], qsl, out, rings[16], W,
                                                              scale, True, pending=(zeros, p_hist, 16), config=tile,
                                                              max_registers=cap, key_rows=kc, stages=st, prefetch=pf),
                    "lazy_fold": lambda i: launch_closed_form(q, k, v, g, beta, pool, src[i], qsl, out, rings[16], W,
                                                              scale, True, pending=(zeros, p_lfold, 16), config=tile,
                                                              max_registers=cap, key_rows=kc, stages=st, prefetch=pf),
                    "folded": lambda i: launch_closed_form(q, k, v, g, beta, pool, src[i], qsl, out, rings[1], W,
                                                           scale, True, pending=(zeros, p_fold, 1), config=tile,
                                                           max_registers=cap, key_rows=kc, stages=st, prefetch=pf),
                }

            # the bit check's inputs, kept before any timed call writes the pool or the rings
            pool_ref = pool[src[0].long()].clone()
            rings_ref = {L: RecordRing(*(x[src[0].long()].clone() for x in r)) for L, r in rings.items()}
            rows0 = torch.arange(B, dtype=torch.int32, device=dev)
            exact_tile = gdn_tile_config(K, V, "verify", sdt, B)
            exact_us, _ = timer.time_call(lambda i: launch_gdn_window(q, k, v, g, beta, pool, src[i], qsl, None, out,
                                                                      rec, scale, True, config=exact_tile), n_sets)
            first = None
            for tile, cap, kc, pkc, st, pf in [(t, c, r, pr, d, f) for t in tiles for c in caps for r in chunks
                                               for pr in plain_chunks for d in depths for f in prefetches]:
                try:
                    variant = calls(tile, cap, kc, pkc, st, pf)
                    times = {name: timer.time_call(c, n_sets)[0] for name, c in variant.items()}
                except Exception as exc:  # a tile the compiler rejects: report, go on
                    print(f"B={B} W={W} tile {tile} cap {cap} ring KC {kc} plain KC {pkc} stages {st} prefetch {pf}: "
                          f"{type(exc).__name__}: {str(exc)[:200]}")
                    continue
                # bits: set 0, fresh copies, every output
                p0, r16, r1 = pool_ref.clone(), RecordRing(*(x.clone() for x in rings_ref[16])), \
                    RecordRing(*(x.clone() for x in rings_ref[1]))
                p1, r16f = pool_ref.clone(), RecordRing(*(x.clone() for x in rings_ref[16]))
                opts = dict(config=tile, max_registers=cap, stages=st, prefetch=pf)
                o_a, rec_a = torch.empty_like(out), tuple(torch.empty_like(x) for x in rec)
                launch_closed_form(q, k, v, g, beta, p0, rows0, qsl, o_a, rec_a, W, scale, True, key_rows=pkc, **opts)
                opts["key_rows"] = kc
                o_b = torch.empty_like(out)
                launch_closed_form(q, k, v, g, beta, p0, rows0, qsl, o_b, r16, W, scale, True,
                                   pending=(zeros, p_hist, 16), **opts)
                o_c = torch.empty_like(out)
                launch_closed_form(q, k, v, g, beta, p0, rows0, qsl, o_c, r1, W, scale, True,
                                   pending=(zeros, p_fold, 1), **opts)
                o_d = torch.empty_like(out)
                launch_closed_form(q, k, v, g, beta, p1, rows0, qsl, o_d, r16f, W, scale, True,
                                   pending=(zeros, p_lfold, 16), **opts)
                bits = (o_a, *rec_a, o_b, o_c, p0, *r16, *r1, o_d, p1, *r16f)
                same = None
                if first is None:
                    first = bits
                else:
                    same = all(torch.equal(a, b) for a, b in zip(first, bits))
                row = {"batch": B, "W": W, "tile": list(tile), "max_registers": cap, "ring_key_rows": kc,
                       "plain_key_rows": pkc, "stages": st, "prefetch": pf, "state_dtype": args.state_dtype,
                       "exact_verify_us": exact_us, **{f"{n}_us": t for n, t in times.items()},
                       **{f"{n}_frac_copy": need[n] / t / 1e3 / copy["gbps"] for n, t in times.items()},
                       "bits_equal_first_tile": same}
                rows.append(row)
                print(f"B={B:>4} W={W} BV={tile[1]:>3} warps={tile[2]} regs={cap} ringKC={kc or '-'} "
                      f"plainKC={pkc or '-'} stages={st or '-'} prefetch={'-' if pf is None else int(pf)} | "
                      f"exact {exact_us:7.1f} | "
                      + " ".join(f"{n} {times[n]:7.1f} ({100 * row[f'{n}_frac_copy']:3.0f}%)" for n in times)
                      + f" | bits {'ref' if same is None else same}", flush=True)
            del pool, rings
            if not cpu:
                torch.cuda.empty_cache()
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s")
    best = {}
    for r in rows:
        for n in ("plain", "lazy_hist", "lazy_fold", "folded"):
            key = (r["batch"], r["W"], n)
            if key not in best or r[f"{n}_us"] < best[key][f"{n}_us"]:
                best[key] = r
    for (B, W, n), r in sorted(best.items()):
        print(f"best B={B} W={W} {n}: BV={r['tile'][1]} warps={r['tile'][2]} regs={r['max_registers']} "
              f"ringKC={r['ring_key_rows'] or '-'} plainKC={r.get('plain_key_rows') or '-'} "
              f"stages={r.get('stages') or '-'} "
              f"prefetch={'-' if r.get('prefetch') is None else int(r['prefetch'])} "
              f"{r[f'{n}_us']:.1f} us "
              f"({100 * r[f'{n}_frac_copy']:.0f}% of copy bw)")
    if not rows:
        print("FAIL: no variant ran (every tile, cap, chunk or depth was refused: see above)")
        return 1
    bad = [r for r in rows if r["bits_equal_first_tile"] is False]
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_gbps": copy["gbps"], "rows": rows}, indent=1))
    if bad:
        print(f"FAIL: {len(bad)} variants' bits differ from the first one's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
