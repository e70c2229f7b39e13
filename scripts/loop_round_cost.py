"""Where the decode loop's time goes, part by part (CUDA only).

Builds the model of ``bench_hf_generate.py``'s width options on the GPU (or loads a trained pair:
``--model demo``, its first held-out prompt, its draft and its checkpoint's MTP head), converts it
with ``cuda_graphs=True`` (``--compile``: with ``compile=False``, ``True`` or each in turn) and runs
``generate`` through the decode loop, plain, with prompt lookup (``--num-draft-tokens``) and, for a
pair, with its draft. One timed call per run is split with CUDA events recorded on the stream
around the prompt's prefill and around every replay of the captured rounds (with ``--mtp-k K``,
also ``use_mtp=True, num_assistant_tokens=K``: the pair's own head, or a random one-layer MTP head
of the width options: what a round of the head's drafts costs against a plain decode round):

- ``prefill``: the prompt's part of the call (the target's prefill, the first token, the drafter's
  start: one replay of its captured graph, or the eager calls; GPU time between its events);
- ``rounds``: the replays' GPU time, per round and per token (a round's graph holds
  ``per_graph`` rounds: 4 plain ones, 1 speculative one);
- ``rest``: the call's wall time minus both (host reads between batches of rounds, the
  launches' latency, output assembly).

It also gives the decode forward's kernel time summed by the profiler (``kernels``), so a
round's graph time over it is what the gaps between kernels and the round's own sampling,
acceptance and commit add; and (unless ``--no-parts``) a few rounds run eagerly and profiled
part by part (draft steps, verify, acceptance, append, commit, the drafter's update, counters:
``benchmarks/round_parts.py``).

    python scripts/loop_round_cost.py --kind qwen3_5 --hidden 2560 --layers 32 ... --new-tokens 128 --mtp-k 3
    python scripts/loop_round_cost.py --model demo --dtype bfloat16 --new-tokens 256 --mtp-k 5 --compile on
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
    rounds, prefill = [], []
    captured_prompt, eager_prompt = loop._prefill_graph, loop._begin

    def timed_graph(width):
        graph = captured_prompt(width)
        return None if graph is None else _TimedGraph(graph, prefill)

    def timed_begin(width):
        if torch.cuda.is_current_stream_capturing():
            return eager_prompt(width)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        eager_prompt(width)
        b.record()
        prefill.append((a, b))

    graph = loop.graph
    loop.graph = _TimedGraph(graph, rounds)
    loop._prefill_graph, loop._begin = timed_graph, timed_begin
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, **kw)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    finally:
        loop.graph = graph
        del loop._prefill_graph, loop._begin
    pre = sum(a.elapsed_time(b) for a, b in prefill)
    rnd = sum(a.elapsed_time(b) for a, b in rounds)
    return out, dict(wall_ms=wall, prefill_ms=pre, rounds_ms=rnd, rest_ms=wall - pre - rnd,
                     replays=len(rounds), rounds=len(rounds) * loop.per_graph)


def main(argv=None) -> int:
    import argparse

    from bench_hf_generate import parse_args
    from forward_timing import loop_forward_gpu_ms
    from hf_loop_runs import batch_prompt
    from hf_runs import DTYPES, SENTENCE, device_model
    from round_parts import round_parts

    from ssm_spec.hf import ByteTokenizer, apply_recoverssm

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--compile", choices=("off", "on", "both"), default="off",
                       help="the loop with compile=False (off), compile=True (on) or each in turn (both)")
    extra.add_argument("--mtp-k", type=int, default=None, metavar="K",
                       help="also use_mtp=True with K drafts: the --model checkpoint's own MTP head, else a random "
                            "one-layer head of the width options (time only)")
    extra.add_argument("--json", default=None, metavar="PATH", help="also write the rows and ratios there")
    extra.add_argument("--no-parts", dest="parts", action="store_false",
                       help="skip the kernel time part by part of a few eager rounds (benchmarks/round_parts.py)")
    mine, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    device = torch.device("cuda")
    tok = ByteTokenizer()
    new = args.new_tokens or 128
    k = args.num_draft_tokens
    draft = None
    if args.model:  # a trained pair (--model demo): its first held-out prompt, its draft, its own MTP head
        from hf_demo import demo_paths, held_out_prompts, mtp_missing

        from ssm_spec.hf.cli_generate import _load_pretrained

        target_dir, draft_dir, manifest = demo_paths(args.model, args.draft)
        if mine.mtp_k is not None and (why := mtp_missing(target_dir)):
            raise SystemExit(f"--mtp-k: {why}")
        model = _load_pretrained(target_dir, "--model", DTYPES[args.dtype], device)
        draft = _load_pretrained(draft_dir, "--draft", DTYPES[args.dtype], device)
        text = held_out_prompts(manifest, 1, args.prompt_bytes)[0]["text"]
        ids = torch.tensor([tok.encode(text)], device=device)
    else:
        model = device_model(args, device)
        ids = batch_prompt(tok, SENTENCE, args.prompt_repeats or 3, 1, device)
    runs = [("plain", {}), ("lookup", {"prompt_lookup_num_tokens": k})]
    if draft is not None:
        runs.append((f"draft k={k}", {"assistant_model": draft, "num_assistant_tokens": k}))
    if mine.mtp_k is not None:
        runs.append((f"mtp k={mine.mtp_k}", {"use_mtp": True, "num_assistant_tokens": mine.mtp_k}))
    rows = []
    for compile_ in {"off": (False,), "on": (True,), "both": (False, True)}[mine.compile]:
        apply_recoverssm(model, decode_loop=True, cuda_graphs=True, compile=compile_)
        if draft is not None:
            apply_recoverssm(draft, decode_loop=True, cuda_graphs=True, compile=compile_)
        if mine.mtp_k is not None and not args.model:
            model._recoverssm.mtp = random_head(model)
        for name, kw in runs:
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
                         kernels_ms=fwd_ms, kernels=kernels, prefill_widths=sorted(loop.prefill_graphs),
                         prefill_failed=loop.prefill_failed)
            if loop.prefill_failed is not None:  # its prefill ran eagerly: the prefill column is not the graph's
                print(f"{name}: prompt part not captured, run eagerly ({loop.prefill_failed})", flush=True)
            if mine.parts:
                parts["round_parts"] = {key: v for key, v in round_parts(model, ids, kw, new).items()
                                        if key != "sequences"}
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
    if mine.parts:
        print_parts(rows)
    by_run = {p["run"]: p["rounds_ms"] / max(p["rounds"], 1) for p in rows}
    ratios = {}
    for run, per_round in by_run.items():
        plain = by_run.get(("compiled " if run.startswith("compiled ") else "") + "plain")
        if plain and not run.endswith("plain"):
            ratios[run] = per_round / plain
            print(f"{run}: a round takes {per_round / plain:.2f}x a plain decode round ({per_round:.3f} / {plain:.3f} ms)")
    if mine.json:
        import json

        from hf_environment import environment

        Path(mine.json).write_text(json.dumps(dict(args={k: v for k, v in vars(args).items()
                                                         if k not in ("out_dir", "compile")},
                                                   script_args=dict(compile=mine.compile, mtp_k=mine.mtp_k, parts=mine.parts),
                                                   rows=rows, round_over_plain_round=ratios,
                                                   environment=environment(device)), indent=1, default=str))
    return 0


def print_parts(rows) -> None:
    """Per run: kernels and kernel ms per round in each part, their total against the replayed
    round's time (what the graph adds between kernels: the rest)."""
    from round_parts import PARTS

    names = [n for n in PARTS if any(n in p["round_parts"]["parts"] for p in rows)]
    print()
    print("kernel ms (kernels) per round, by part; replay: the captured round's time")
    print(f"{'run':16s} | " + " | ".join(f"{n:>16s}" for n in names) + " |    total | replay")
    for p in rows:
        got = p["round_parts"]["parts"]
        cells = [f"{got[n]['ms']:7.3f} ({got[n]['kernels']:5.0f})" if n in got else f"{'-':>16s}" for n in names]
        replay = p["rounds_ms"] / max(p["rounds"], 1)
        print(f"{p['run']:16s} | " + " | ".join(cells) + f" | {p['round_parts']['ms']:8.3f} | {replay:.3f}")


def random_head(model):
    """A one-layer MTP head of ``model``'s widths with random weights, on its device and in its
    dtype (for timing: it accepts next to nothing)."""
    from ssm_spec.hf.mtp.head import MTPHead

    weight = model.get_input_embeddings().weight
    head = MTPHead.for_model(model, num_layers=1, device=weight.device)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return head.to(weight.dtype).requires_grad_(False).eval()


if __name__ == "__main__":
    sys.exit(main())
