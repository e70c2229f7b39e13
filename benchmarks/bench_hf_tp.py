"""Greedy ``generate`` with prompt lookup on a converted Hugging Face model whose GDN layers are
sharded over the ranks of ``torchrun`` (``apply_recoverssm(model, tp_group=WORLD)``).

Every rank builds the same random-weight model (:func:`ssm_spec.hf.tiny_model`, ``--kind``, the
widths and weight scales of ``bench_hf_generate.py``: its options, its defaults, but fp32 by
default so the tokens can be compared) on ``cuda:$LOCAL_RANK``, converts it with its GDN layers
sharded over the world (each rank keeps ``1/N`` of the key and value heads; attention, MLPs,
embeddings and LM head stay whole, as ``apply_recoverssm`` leaves them), and times greedy
``generate`` (``--new-tokens``, median of ``--repeats`` after a warm-up) plain and with prompt
lookup (``prompt_lookup_num_tokens = --num-draft-tokens``) on a repetitive byte prompt.

Rank 0 first runs the reference: the same model converted without sharding, on its GPU alone,
plain greedy and prompt lookup (the TP 1 tokens/s). Every rank's tokens are compared with the
reference's plain greedy tokens (``equal_to_tp1`` per rank, and the first differing index: in
fp32 they part only after a near-tie, the all-reduce adding partial sums in another order) and
with each other. Rank 0 prints the result and writes ``hf_tp<N>_<kind>_<dtype>.json``
(``hf_tp<N>_quick_...`` for a smoke run).

Launch: ``torchrun --nproc-per-node N`` (NCCL on CUDA, gloo on the CPU; the environment's NCCL
variables are kept as they are and recorded). ``--quick`` (tiny widths) with ``--device cpu``
is the smoke run. Results go to ``benchmarks/out/`` (git-ignored) unless asked otherwise:
``--save`` writes ``benchmarks/results/`` (refused for a smoke run), ``--out-dir DIR`` writes DIR.

Usage::

    torchrun --nproc-per-node 2 benchmarks/bench_hf_tp.py --out-dir OUT             # 2 GPUs, fp32
    torchrun --nproc-per-node 2 benchmarks/bench_hf_tp.py --device cpu --quick     # smoke test
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from _results import write_results
from bench_hf_generate import parse_args as hf_parse_args
from bench_step_tp import join_group, leave_group, nccl_environment
from hf_agreement import first_diff
from hf_environment import environment
from hf_runs import SENTENCE, model_config, timed_generate
from timing import Clock, Phases


def parse_args(argv=None):
    """``bench_hf_generate.py``'s options (widths, ``--kind``, ``--new-tokens``, ``--repeats``,
    ``--num-draft-tokens``, ``--out-dir`` / ``--save``, ...), with ``--dtype float32`` by
    default; its run selection (``--no-graphs``, ``--no-hf-torch``, ``--model``) does not apply."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = hf_parse_args(["--dtype", "float32", *argv])  # a later --dtype wins

    def usage_error(message: str):
        print(f"bench_hf_tp.py: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    if args.model is not None:
        usage_error("--model is not supported (random-weight kinds only)")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked before any rank builds a model
    for name in ("key_heads", "value_heads"):
        if getattr(args, name) % world:
            usage_error(f"--{name.replace('_', '-')} {getattr(args, name)} is not divisible by the {world} ranks "
                        "(each keeps an equal share of the GDN heads)")
    return args


def _generate(model, prompt, clock, phases, name, k, common) -> dict:
    """Plain greedy and prompt-lookup ``generate``, timed (``hf_runs.timed_generate``)."""
    plain = timed_generate(model, prompt, clock, phases, f"{name} plain", **common)
    lookup = timed_generate(model, prompt, clock, phases, f"{name} lookup",
                            make_extra=lambda: {"prompt_lookup_num_tokens": k}, **common)
    return {run: {key: r[key] for key in ("tokens", "time_s", "times_s", "tokens_per_s", "times_spread")}
            for run, r in (("plain", plain), ("lookup", lookup))}


@torch.no_grad()
def run(args) -> dict | None:
    from ssm_spec.hf import ByteTokenizer, apply_recoverssm, tiny_model

    dev, group, rank, world = join_group(args.device)
    backend = dist.get_backend(group) if group is not None else None
    if rank:
        sys.stdout = open(os.devnull, "w")
    dtype, state_dtype = getattr(torch, args.dtype), getattr(torch, args.state_dtype)
    cfg, init = model_config(args)
    clock = Clock(dev)
    phases = Phases(clock)
    prompt = torch.tensor([ByteTokenizer().encode(SENTENCE * args.prompt_repeats)], device=dev)
    common = dict(new_tokens=args.new_tokens, warmup_tokens=args.warmup_tokens, repeats=args.repeats)
    k = args.num_draft_tokens

    def build():
        return tiny_model(args.kind, seed=args.seed, dtype=dtype, **init, **cfg).to(dev)

    ref = [None]
    if rank == 0:  # the unsharded converted model on this GPU alone
        model = apply_recoverssm(build(), state_dtype=state_dtype)
        ref[0] = _generate(model, prompt, clock, phases, "tp1", k, common)
        print(f"TP 1 (rank 0 alone): plain {ref[0]['plain']['tokens_per_s']:8.1f} tok/s, "
              f"lookup {ref[0]['lookup']['tokens_per_s']:8.1f} tok/s", flush=True)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if group is not None:
        dist.broadcast_object_list(ref, src=0, group=group)
    ref = ref[0]
    model = apply_recoverssm(build(), state_dtype=state_dtype, tp_group=group)
    heads = next(m for m in model.modules() if hasattr(m, "engine_forward")).num_v_heads
    ours = _generate(model, prompt, clock, phases, f"tp{world}", k, common)
    want = ref["plain"]["tokens"]
    mine = {run: {"equal_to_tp1": ours[run]["tokens"] == want, "first_diff": first_diff(ours[run]["tokens"], want),
                  "tokens": ours[run]["tokens"], "tokens_per_s": ours[run]["tokens_per_s"]} for run in ours}
    per_rank = [mine]
    if group is not None:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine, group=group)
    del model  # its sharded layers hold the group
    leave_group(group)
    if rank:
        return None
    ranks_agree = all(r[run]["tokens"] == per_rank[0][run]["tokens"] for r in per_rank for run in r)
    return {
        "device": environment(dev)["device"],
        "environment": environment(dev),
        "tp": world,
        "backend": backend,
        **nccl_environment(),
        "config": {"kind": args.kind, **cfg, **init, "dtype": args.dtype, "state_dtype": args.state_dtype,
                   "new_tokens": args.new_tokens, "warmup_tokens": args.warmup_tokens, "repeats": args.repeats,
                   "num_draft_tokens": k, "prompt_tokens": prompt.shape[1], "quick": args.quick,
                   "value_heads_per_rank": heads},
        "tp1": ref,
        "tpN": ours,
        "equal_to_tp1": {run: [r[run]["equal_to_tp1"] for r in per_rank] for run in ours},
        "first_diff": {run: [r[run]["first_diff"] for r in per_rank] for run in ours},
        "ranks_agree": ranks_agree,
        "speedup_lookup_over_plain": ours["lookup"]["tokens_per_s"] / ours["plain"]["tokens_per_s"],
        "tpN_over_tp1": {run: ours[run]["tokens_per_s"] / ref[run]["tokens_per_s"] for run in ours},
        "phases_s": phases.seconds,
    }


def print_result(res: dict) -> None:
    c = res["config"]
    print(f"\n{res['device']}  TP {res['tp']}  {c['kind']} {c['dtype']}, {c['new_tokens']} new tokens, "
          f"k = {c['num_draft_tokens']}, {c['value_heads_per_rank']} value heads per rank")
    for run in ("plain", "lookup"):
        eq = res["equal_to_tp1"][run]
        print(f"{run:<7} TP 1 {res['tp1'][run]['tokens_per_s']:9.1f} tok/s   TP {res['tp']} "
              f"{res['tpN'][run]['tokens_per_s']:9.1f} tok/s   (x{res['tpN_over_tp1'][run]:.2f})   tokens = TP 1 "
              f"plain greedy on every rank: {all(eq)} (first differences {res['first_diff'][run]})")
    print(f"ranks agree: {res['ranks_agree']}")


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    res = run(args)
    if res is not None:
        print_result(res)
        name = "quick_" if res["config"]["quick"] else ""
        stem = f"hf_tp{res['tp']}_{name}{res['config']['kind']}_{res['config']['dtype']}"
        write_results(res, args.out_dir, stem, lambda res, path: False)
    return res


if __name__ == "__main__":
    main()
