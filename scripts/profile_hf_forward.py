"""Where the host time of one HF forward goes, unconverted vs converted (development aid).

Builds the model of benchmarks/bench_hf_generate.py (hidden 2048, 8 layers, bf16), prefills a
304-token prompt, then for transformers' own path (W=1 decode) and for the converted model
(W=1 and W=k+1 verify, each followed by ``crop(-W)``) prints:

* wall ms per forward (synchronised) and CUDA kernel ms per forward (torch.profiler), so the
  gap between them is host time;
* the number of CUDA kernel launches per forward;
* the top functions by own time (cProfile over ``--reps`` forwards).

Writes the full text under ``--out-dir`` (default $OUT or /tmp).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch


def forward_loop(model, x, cache, key, seen, reps, rollback):
    times = []
    for _ in range(reps):
        mask = torch.ones(1, seen + x.shape[1], dtype=torch.long, device=x.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=x, attention_mask=mask, use_cache=True, **{key: cache})
        if rollback:
            cache.crop(-x.shape[1])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if not rollback:
            seen += x.shape[1]
    return times, seen


def profile(label, model, x, cache, key, seen, reps, rollback, top, log):
    with torch.no_grad():
        forward_loop(model, x, cache, key, seen, 3, rollback)  # warm
        seen += 0 if rollback else 3 * x.shape[1]
        times, seen = forward_loop(model, x, cache, key, seen, reps, rollback)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile
        n = 5
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, seen = forward_loop(model, x, cache, key, seen, n, rollback)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        cuda_ms = sum(e.device_time for e in kernels) / 1e3 / n
        launches = len(kernels) / n
        pr = cProfile.Profile()
        pr.enable()
        _, seen = forward_loop(model, x, cache, key, seen, reps, rollback)
        pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(top)
    wall = 1e3 * statistics.median(times)
    line = f"{label:<28} wall {wall:7.3f} ms  cuda {cuda_ms:7.3f} ms  launches {launches:6.1f}"
    log(f"\n===== {line}\n--- by own time\n{s.getvalue()}\n--- by cumulative time\n{s2.getvalue()}")
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return line, seen


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp"))
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_hf_generate import FULL
    from hf_runs import SENTENCE

    from ssm_spec.hf import ByteTokenizer, RecoverSSMCache, apply_recoverssm, tiny_model
    from ssm_spec.hf.apply import cache_kwarg

    out = Path(args.out_dir) / "profile_hf_forward.txt"
    fh = out.open("w")

    def log(msg):
        fh.write(msg + "\n")
        fh.flush()

    dev = torch.device("cuda")
    cfg = dict(hidden_size=FULL["hidden"], num_layers=FULL["layers"], linear_num_key_heads=FULL["key_heads"],
               linear_num_value_heads=FULL["value_heads"], linear_head_dim=FULL["head_dim"],
               num_attention_heads=FULL["attn_heads"], num_key_value_heads=FULL["kv_heads"],
               head_dim=FULL["attn_head_dim"], intermediate_size=FULL["intermediate"])
    model = tiny_model("qwen3_next", dtype=torch.bfloat16, std=0.2 * math.sqrt(64 / FULL["hidden"]), **cfg).to(dev)
    prompt = torch.tensor([ByteTokenizer().encode(SENTENCE * FULL["prompt_repeats"])], device=dev)
    P = prompt.shape[1]
    key = cache_kwarg(model)
    lines = []
    with torch.no_grad():
        o = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True)
        cache = o.past_key_values
    line, _ = profile("hf W=1 (advancing)", model, prompt[:, -1:], cache, key, P, args.reps, False, args.top, log)
    lines.append(line)
    print(line, flush=True)

    apply_recoverssm(model)
    cache = RecoverSSMCache(model, max_pending=args.k + 1)
    with torch.no_grad():
        model(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True, **{key: cache})
        cache.crop(0)
    for W in (1, args.k + 1):
        line, _ = profile(f"ours W={W} (+crop)", model, prompt[:, -W:], cache, key, P, args.reps, True,
                          args.top, log)
        lines.append(line)
        print(line, flush=True)
    fh.close()
    print(f"wrote {out}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
