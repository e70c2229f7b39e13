"""Capture a Qwen3-Next-shaped stack's whole spec-decode step as CUDA graphs and replay it.

Builds :class:`ssm_spec.graphs.stack.DecoderStack` (default: realistic widths, hidden 2048, 8 layers,
GDN 16 key / 32 value heads of dim 128, attention 16/2 heads of dim 128, MLP 5632, bf16
weights, fp32 states), prefills one random prompt per request, captures
:class:`ssm_spec.graphs.SpecDecodeGraphRunner` for the chosen batch sizes and, per batch, times

* ``eager``: the step body run eagerly on the runner's buffers (what an engine without
  graphs pays), and
* ``graph``: ``runner.step(...)`` (copy inputs into the static buffers, replay the bucket),

each as GPU wall time per step (synchronised) and host time per step (the Python call alone,
no synchronisation: what the CPU spends to launch one step). Before timing it checks that a
replay gives the eager step's tokens. Steps run with a fixed window of ``k`` random drafts
(states advance; positions stay put so the KV buffer never overflows).

    python examples/compile_graph_capture.py                      # CUDA, batch 1 16 64
    python examples/compile_graph_capture.py --quick --device cpu # tiny, eager only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ssm_spec.graphs import SpecDecodeGraphRunner
from ssm_spec.graphs.stack import REALISTIC_WIDTHS, TINY_WIDTHS, DecoderStack
from ssm_spec import RecoverSSMMetadata, StatePool


def _time(fn, reps, sync):
    """Median wall time (synchronised) and median host time (the call alone) in ms."""
    walls, hosts = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        hosts.append(1e3 * (t1 - t0))
        walls.append(1e3 * (t2 - t0))
    return statistics.median(walls), statistics.median(hosts)


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny widths (a smoke run)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("-k", "--num-draft-tokens", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    widths = TINY_WIDTHS if args.quick else REALISTIC_WIDTHS
    dtype = getattr(torch, args.dtype)
    W, bmax = args.num_draft_tokens + 1, max(args.batch)
    reps = 3 if args.quick else args.reps
    model = DecoderStack(**widths, max_len=args.prompt_len + 2 * W, num_slots=bmax, device=dev, dtype=dtype)
    model.randomize(0).eval()
    pool = StatePool(model.recurrent_layers(), num_slots=bmax, max_tokens=max(bmax * W, 1), device=dev)
    gen = torch.Generator().manual_seed(0)
    V = widths["vocab_size"]
    prompts = torch.randint(0, V, (bmax, args.prompt_len), generator=gen)
    md = RecoverSSMMetadata.build([args.prompt_len] * bmax, [True] * bmax, [0] * bmax, list(range(bmax)),
                                  num_slots=bmax, device=dev)
    model(prompts.reshape(-1).to(dev), md, pool)  # prefill every request (fla-core on CUDA when installed)
    runner = SpecDecodeGraphRunner(model, pool, args.num_draft_tokens, V, buckets=args.batch)
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}: stack {widths}, {args.dtype}, "
          f"W={W}; captured {len(runner.graphs)} bucket(s) in {capture_s:.1f} s")
    rows = []
    for B in args.batch:
        window = torch.randint(0, V, (B, W), generator=gen).to(dev)
        lens = torch.full((B,), W, dtype=torch.int32, device=dev)
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        nct = torch.full((B,), args.prompt_len, dtype=torch.int32, device=dev)

        def graph_step():
            runner.step(window, lens, slots, nct, validate=False)

        def eager_step():
            runner.eager_step(runner.bucket_for(B))

        graph_step()  # loads the buffers (and replays once)
        same = None
        if runner.graphs:  # a replay equals the eager body on the same buffers and state
            states = [s.clone() for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())]
            e = [t.clone() for t in runner.eager_step(B)]
            for (s, _), saved in zip((*pool.gdn_groups.values(), *pool.conv_groups.values()), states):
                s.copy_(saved)
            runner.replay(B)
            sync()
            same = torch.equal(e[0], runner.accepted_tokens[:B]) and torch.equal(e[1], runner.num_accepted_tokens[:B])
        eager_wall, eager_host = _time(eager_step, reps, sync)
        row = {"batch": B, "eager_ms": eager_wall, "eager_host_ms": eager_host, "replay_equals_eager": same}
        if runner.graphs:
            row["graph_ms"], row["graph_host_ms"] = _time(graph_step, reps, sync)
            row["speedup"] = eager_wall / row["graph_ms"]
        rows.append(row)
    head = f"{'batch':>5} | {'eager ms':>9} {'host ms':>8} | {'graph ms':>9} {'host ms':>8} | {'speedup':>7} | replay==eager"
    print(head)
    print("-" * len(head))
    for r in rows:
        g = (f"{r['graph_ms']:9.3f} {r['graph_host_ms']:8.3f} | {r['speedup']:6.2f}x"
             if "graph_ms" in r else f"{'-':>9} {'-':>8} | {'-':>7}")
        print(f"{r['batch']:5d} | {r['eager_ms']:9.3f} {r['eager_host_ms']:8.3f} | {g} | {r['replay_equals_eager']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"widths": widths, "dtype": args.dtype, "W": W, "capture_s": capture_s, "rows": rows}, f, indent=1)
    return 0 if all(r["replay_equals_eager"] in (None, True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
