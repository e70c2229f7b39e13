"""A converted model's decode and verify forwards, separate against fused projections and eager
against compiled: GPU time, kernels, the GEMMs' share, the first call's cost (CUDA only).

Builds the model of ``bench_hf_generate.py``'s width options on the GPU and times, for each
variant (``apply_recoverssm(model, fused_projections=..., compile=...)``; with fused projections the
narrow ones run as inductor's one-row GEMV when compiled, ``ssm_spec.hf.narrow_gemv``; the last two
variants run them through cuBLAS instead, and through ``benchmarks/splitk_gemv.py``'s split-K
GEMV tuned per shape), one target forward of
W = 1 (a decode step) and of each ``--widths`` inside the decode loop
(``forward_timing.loop_forward_gpu_ms``: kernel time summed, so launch gaps do not count), against
the weight-read floor at the copy bandwidth measured in the same run; then the plain decode
loop's tokens/s with CUDA graphs for each variant (``--new-tokens`` tokens, after a warm-up call).

    python scripts/forward_cost.py --kind qwen3_5 --hidden 2560 --layers 32 ... --out $OUT/forward_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

#: (name, fused projections, compiled, the narrow projections' product: "library" (what conversion
#: gives: inductor's one-row GEMV when compiled), "cublas" (F.linear) or "splitk" (benchmarks/splitk_gemv.py))
VARIANTS = (("separate, eager", False, False, "library"), ("fused, eager", True, False, "library"),
            ("fused, compiled", True, True, "library"), ("fused, compiled, cuBLAS narrow", True, True, "cublas"),
            ("fused, compiled, split-K narrow", True, True, "splitk"))


def main(argv=None) -> int:
    from bench_hf_generate import parse_args
    from forward_timing import copy_bandwidth, loop_forward_gpu_ms, weight_read_floor_ms
    from hf_loop_runs import batch_prompt
    from hf_runs import SENTENCE, device_model

    from ssm_spec.hf import ByteTokenizer, apply_recoverssm
    from ssm_spec.hf.narrow_gemv import drop_narrow_gemv, use_narrow_gemv

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--widths", type=int, nargs="+", default=[4, 6])
    extra.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS])
    extra.add_argument("--out", type=Path, default=None)
    mine, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    device = torch.device("cuda")
    model = device_model(args, device)
    apply_recoverssm(model)
    bandwidth = copy_bandwidth(device)
    floor_ms, nbytes = weight_read_floor_ms(model, bandwidth)
    ids = batch_prompt(ByteTokenizer(), SENTENCE, args.prompt_repeats or 3, 1, device)
    new = args.new_tokens or 128
    res = {"copy_bandwidth_GBps": bandwidth / 1e9, "param_bytes": nbytes, "weight_read_floor_ms": floor_ms,
           "kind": args.kind, "hidden": args.hidden, "layers": args.layers, "variants": {}}
    print(f"floor {floor_ms:.3f} ms ({nbytes / 1e9:.2f} GB at {bandwidth / 1e9:.0f} GB/s)", flush=True)
    for name, fused, compiled, narrow in VARIANTS:
        if name not in mine.variants:
            continue
        apply_recoverssm(model, fused_projections=fused, compile=compiled, decode_loop=True, cuda_graphs=True)
        entry = {"fused_projections": fused, "compile": compiled, "narrow": narrow, "forwards": {}}
        splitk = narrow == "splitk"
        if narrow != "library":
            entry["narrow_modules_restored"] = drop_narrow_gemv(model)  # nn.Linear: cuBLAS, or swapped below
        if splitk:
            from splitk_gemv import TUNED, use_splitk

            entry["splitk_modules"] = len(use_splitk(model, rows=sorted({1, *mine.widths})))
            entry["splitk_configs"] = {f"{m}x{n}x{k}": c for (m, n, k, _), c in TUNED.items()}
        if narrow != "library":
            # the same settings as the variant before: its decode loop holds graphs (and compiled
            # forwards) of the unswapped modules, so drop it and the compiled code with it
            model._recoverssm.drop_loop()
            torch._dynamo.reset()
        for W in [1, *mine.widths]:
            f = loop_forward_gpu_ms(model, W, compile=compiled)
            entry["forwards"][str(W)] = f
            print(f"{name}: W={W} {f['ms']:.3f} ms, {f['kernels']} kernels, GEMMs {f['gemm_kernels']} in "
                  f"{f['gemm_ms']:.3f} ms, first call {f['first_call_s']:.1f} s", flush=True)
            print("  by kind: " + ", ".join(f"{kind} {v['kernels']} in {v['ms']:.3f} ms"
                                            for kind, v in f["breakdown"]["by_kind"].items()), flush=True)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new, do_sample=False)  # capture (and compile), warm
        entry["first_generate_s"] = time.perf_counter() - t
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        entry["loop_tokens_per_s"] = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)
        entry["graph_replays"] = model._recoverssm.loop.replays
        if splitk:
            use_splitk(model, enable=False)
        if narrow != "library":
            use_narrow_gemv(model)  # what conversion gave
            model._recoverssm.drop_loop()  # its graphs read the swapped modules
            torch._dynamo.reset()
        res["variants"][name] = entry
        print(f"{name}: loop {entry['loop_tokens_per_s']:.1f} tok/s (first call {entry['first_generate_s']:.1f} s)",
              flush=True)
    if mine.out:
        mine.out.write_text(json.dumps(res, indent=1))
    print(f"\n{'variant':31s} | {'W':>2s} | {'GPU ms':>7s} | {'/floor':>6s} | {'/W=1':>5s} | kernels | "
          f"GEMM ms (n) | first s | loop tok/s")
    for name, e in res["variants"].items():
        d = e["forwards"]["1"]["ms"]
        for W, f in e["forwards"].items():
            print(f"{name:31s} | {W:>2s} | {f['ms']:7.3f} | {f['ms'] / floor_ms:6.2f} | {f['ms'] / d:5.2f} | "
                  f"{f['kernels']:7d} | {f['gemm_ms']:6.3f} ({f['gemm_kernels']:3d}) | {f['first_call_s']:7.1f} | "
                  + (f"{e['loop_tokens_per_s']:.1f}" if W == "1" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
