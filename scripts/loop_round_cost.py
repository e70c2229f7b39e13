"""Where the decode loop's time goes, part by part (CUDA only).

Builds the model of ``bench_hf_generate.py``'s width options on the GPU, converts it with
``cuda_graphs=True`` (and with ``--compile``, also ``compile=True``) and runs ``generate``
through the decode loop, plain and with prompt lookup. One timed call per run is split with
CUDA events recorded on the stream around the prompt's prefill and around every replay of the
captured rounds:

- ``prefill``: the prompt's forward (GPU time between its events);
- ``rounds``: the replays' GPU time, per round and per token (a round's graph holds
  ``per_graph`` rounds: 4 plain ones, 1 speculative one);
- ``rest``: the call's wall time minus both (host reads between batches of rounds, the
  launches' latency, output assembly).

It also gives the decode forward's kernel time summed by the profiler (``kernels``), so a
round's graph time over it is what the gaps between kernels and the round's own sampling,
acceptance and commit add.

    python scripts/loop_round_cost.py --kind qwen3_5 --hidden 2560 --layers 32 ... --new-tokens 128
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class _TimedGraph:
    """A captured graph whose every replay is bracketed by CUDA events."""

    def __init__(self, graph, spans):
        self.graph, self.spans = graph, spans

    def replay(self):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.graph.replay()
        b.record()
        self.spans.append((a, b))


def split_call(model, ids, kw, new):
    """One timed ``generate`` split into prefill / rounds / rest (ms), with the loop's counts."""
    loop = model._recoverssm.loop
    target = loop.target
    rounds, prefill = [], []
    original_prefill = target.prefill

    def timed_prefill(*args, **kwargs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = original_prefill(*args, **kwargs)
        b.record()
        prefill.append((a, b))
        return out

    graph = loop.graph
    loop.graph = _TimedGraph(graph, rounds)
    target.prefill = timed_prefill
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, **kw)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    finally:
        loop.graph = graph
        del target.prefill
    pre = sum(a.elapsed_time(b) for a, b in prefill)
    rnd = sum(a.elapsed_time(b) for a, b in rounds)
    return out, dict(wall_ms=wall, prefill_ms=pre, rounds_ms=rnd, rest_ms=wall - pre - rnd,
                     replays=len(rounds), rounds=len(rounds) * loop.per_graph)


def main(argv=None) -> int:
    import argparse

    from bench_hf_generate import parse_args
    from forward_timing import loop_forward_gpu_ms
    from hf_loop_runs import batch_prompt
    from hf_runs import SENTENCE, device_model

    from ssm_spec.hf import ByteTokenizer, apply_recoverssm

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--compile", action="store_true", help="also the loop with compile=True")
    mine, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    device = torch.device("cuda")
    model = device_model(args, device)
    tok = ByteTokenizer()
    new = args.new_tokens or 128
    ids = batch_prompt(tok, SENTENCE, args.prompt_repeats or 3, 1, device)
    rows = []
    for compile_ in (False, True) if mine.compile else (False,):
        apply_recoverssm(model, decode_loop=True, cuda_graphs=True, compile=compile_)
        for name, kw in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": args.num_draft_tokens})):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=new, do_sample=False, **kw)  # capture, compile, warm
            first = time.perf_counter() - t
            loop = model._recoverssm.loop
            if loop.graph is None:
                print(f"{name}: not captured ({loop.failed})")
                continue
            out, parts = split_call(model, ids, kw, new)
            produced = out.shape[1] - ids.shape[1]
            fwd = loop_forward_gpu_ms(model, 1, compile=compile_)
            fwd_ms, kernels = fwd["ms"], fwd["kernels"]
            parts.update(run=("compiled " if compile_ else "") + name, tokens=produced, first_call_s=first,
                         kernels_ms=fwd_ms, kernels=kernels)
            rows.append(parts)
            print(parts, flush=True)
    print()
    print(f"{'run':16s} | wall/tok | prefill/tok | round ms | rounds | tok/round | round/kernels | rest/tok | "
          f"decode kernels (count)")
    for p in rows:
        per_round = p["rounds_ms"] / max(p["rounds"], 1)
        print(f"{p['run']:16s} | {p['wall_ms'] / p['tokens']:8.3f} | {p['prefill_ms'] / p['tokens']:11.3f} | "
              f"{per_round:8.3f} | {p['rounds']:6d} | {(p['tokens'] - 1) / max(p['rounds'], 1):9.2f} | "
              f"{per_round / p['kernels_ms']:13.2f} | {p['rest_ms'] / p['tokens']:8.3f} | "
              f"{p['kernels_ms']:.3f} ms ({p['kernels']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
