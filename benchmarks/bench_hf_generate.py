"""Benchmark transformers ``generate`` against prompt lookup through ``RecoverSSMCache``.

One run builds a random-weight model of one published class with realistic widths
(:func:`ssm_spec.hf.tiny_model`, ``--kind``: Qwen3-Next dense or with expert layers, Qwen3.5
dense, mixture-of-experts or the vision-language class; default hidden 2048, 8 layers, 16 key /
32 value GDN heads of dim 128, 16 attention heads of dim 128 with 2 KV heads, MLP 5632; the
expert kinds: 64 experts of width 512, top-8, plus a shared expert of width 512; bf16) and a repetitive byte
prompt (a sentence repeated ``--prompt-repeats`` times, batch 1), then measures, each after a
warm-up ``generate`` (full length by default, so every kernel is compiled and every draft width
seen) and as the median of ``--repeats`` timed calls:

1. ``hf``: plain greedy ``generate`` on the unconverted model, with whatever GDN functions
   transformers bound at import (``use_kernel_func_from_hub_with_fallback``: fla-core's and
   causal-conv1d's kernels where installed, its own PyTorch functions otherwise);
2. ``hf-torch``: the same, with transformers' PyTorch reference functions (the modeling
   modules' ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
   ``causal_conv1d_fn``, ``causal_conv1d_update`` replaced by ``inspect.unwrap`` of themselves
   for this run only, see :func:`ssm_spec.hf.kernels.hf_reference_kernels`): what plain transformers runs without
   fla-core. Where ``hf`` already resolved to these functions (no fla-core, e.g. on CPU) it is
   the same path, run again, and the JSON says so (``hf_torch_same_as_hf``). ``--no-hf-torch``
   skips it;
3. ``ours``: plain greedy ``generate`` on the same model after ``apply_recoverssm`` (converted
   in place, so this runs after the baselines);
4. ``ours+lookup``: ``generate(prompt_lookup_num_tokens=k)`` on the converted model, with a
   ``RecoverSSMCache`` passed in to read its acceptance stats afterwards;
``hf_lookup``: transformers' own ``prompt_lookup_num_tokens=k`` on the unconverted model (releases
from 5.25 run assisted decoding on GDN models themselves, with a history of recurrent states;
older ones refuse it, and the run is recorded as skipped with the refusal); ``hf_static``:
plain greedy with ``cache_implementation="static"``, the path transformers compiles on CUDA
(skipped, with the error, where a release cannot build that cache for the model). Both run
before the conversion and are compared with ``hf`` token for token like every other run.

5. ``graphs`` and 6. ``graphs+lookup``: (3) and (4) with ``apply_recoverssm(model,
   cuda_graphs=True)``: every forward after the prompt replays a captured CUDA graph
   (``ssm_spec.hf.graphed``; captured in the warm-up call, kept on the model). ``--no-graphs``
   skips them. (3)-(6) run through transformers' own decoding loop (``decode_loop=False``);
7. ``loop`` and 8. ``loop+lookup``: the same through ssm-spec's decode loop (``decode_loop=True``,
   the default of a converted model: the whole round on the device, captured as one CUDA graph
   with ``--graphs`` on CUDA), at each ``--batch`` size (``loop@B``, ``loop+lookup@B`` beyond
   batch 1), with the GPU time of one decode and one verify forward inside the loop
   (``gpu_ms_per_decode_forward``, ``gpu_ms_per_verify_forward``: kernel time summed) and the
   weight-read floor at the copy bandwidth measured in the run (``benchmarks/hf_loop_runs.py``).
   ``--no-loop`` skips them.

Every run produces exactly ``--new-tokens`` tokens (``max_new_tokens = min_new_tokens``). It
reports tokens/s (prompt prefill included), the speedups of ``ours`` and ``ours+lookup`` over
both baselines (``hf`` and ``hf-torch``), the kernels each baseline resolved to, and whether
the token sequences agree; in bf16 they may part after a near-tie (``hf-torch`` from ``hf``
too: other kernels, other rounding), so for each pair it gives the first differing index and
the logit gap there (top-1 minus top-2, and the logit of one run's token minus the other's),
from a forward of the unconverted model (``hf``'s kernels) over the prefix of ``hf``
(computed once over the whole plain sequence, before the conversion).

It also times single forwards with a warm cache: W = 1 (a decode step) and W = k + 1 (a
verify step) through the converted model (``RecoverSSMCache`` holding the prompt; each
forward is followed by ``crop(-W)``, so the state is the same every time; forward and crop
timed separately, median of ``--forward-reps``), and W = 1 through the unconverted model with
``hf``'s kernels and transformers' cache (the state advances, as it cannot roll back;
``--hf-verify-forward`` adds W = k + 1 there too).

The weights are ``tiny_model``'s, with its linear-weight std scaled with the width by default
(``--std``: ``0.2 * sqrt(64 / hidden)``, i.e. ``tiny_model``'s own 0.2 at its hidden size of 64).
At the unscaled 0.2 a 2048-wide model's residual stream is dominated by the MLPs (activations
grow with sqrt(width)), greedy text never repeats and prompt lookup accepts nothing; scaled,
the model keeps the tiny model's behaviour (the current token's embedding matters, greedy text
falls into loops that prompt lookup can draft from). ``--std 0.2`` gives the unscaled model.

``--quick`` is a smoke test of the script (tiny widths, few tokens; runs on CPU in seconds).

Results (JSON and plot) go to ``benchmarks/out/`` (git-ignored) unless asked otherwise: ``--save``
writes ``benchmarks/results/``, the committed GPU runs (refused for a CPU or ``--quick`` smoke
run), ``--out-dir DIR`` writes DIR. The output's first lines say where. While a random-weight
run goes, the rows measured so far are kept beside it in ``<name>.partial.json`` (a run killed
by a time limit leaves them); the whole result replaces that file.

Usage::

    python benchmarks/bench_hf_generate.py --save              # cuda, bf16, 256 new tokens, committed
    python benchmarks/bench_hf_generate.py --dtype float32
    python benchmarks/bench_hf_generate.py --device cpu --quick
    python benchmarks/bench_hf_generate.py --no-hf-torch       # skip the PyTorch-reference baseline
"""

from __future__ import annotations

import argparse
import math

import torch
from _results import HelpFormatter, PartialResults, add_out_args, resolve_out_dir, write_results
from hf_demo import demo_paths, held_out_prompts, mtp_missing, print_demo, run_demo, save_demo_plot
from hf_environment import environment
from hf_report import print_table, save_plot
from hf_runs import DTYPES, run

from ssm_spec.hf.tiny import KINDS

#: ``--model``'s default warm-up on the CPU, where nothing compiles: the pair's prompts make
#: 7 runs x 4 prompts x (warm-up + 2 timed calls) of eager generate. On CUDA the warm-up is the
#: whole length (as for the random-weight kinds): a 32-token warm-up there left the first timed
#: call of several runs 2-4.5x slower than the second (docs/perf-notes.md, "Warm-up").
DEMO_WARMUP_TOKENS = 32
#: Widths of the default (H200) model and of ``--quick``.
FULL = dict(hidden=2048, layers=8, key_heads=16, value_heads=32, head_dim=128, attn_heads=16,
            kv_heads=2, attn_head_dim=128, intermediate=5632, new_tokens=256, repeats=2,
            forward_reps=20, prompt_repeats=4, experts=64, experts_per_token=8, moe_intermediate=512)
QUICK = dict(hidden=64, layers=4, key_heads=2, value_heads=4, head_dim=16, attn_heads=4,
             kv_heads=2, attn_head_dim=16, intermediate=128, new_tokens=32, repeats=1,
             forward_reps=5, prompt_repeats=3, experts=4, experts_per_token=2, moe_intermediate=32)


def result_name(kind: str, dtype: str) -> str:
    """The results file's stem: ``hf_generate_<dtype>`` for the dense Qwen3-Next (the first
    benchmark's name, kept), ``hf_generate_<kind>_<dtype>`` for every other kind."""
    return f"hf_generate_{dtype}" if kind == "qwen3_next" else f"hf_generate_{kind}_{dtype}"


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="tiny widths and few tokens (a CPU smoke run)")
    p.add_argument("--model", default=None, metavar="demo|PATH",
                   help="benchmark a trained pair instead of a random-weight model: 'demo' (the packaged pair, "
                        "ssm_spec.assets) or a training run's target directory (scripts/train_demo_model.py), on "
                        "held-out code prompts (benchmarks/hf_demo.py); --kind and the width options are ignored")
    p.add_argument("--draft", default=None, metavar="PATH",
                   help="with --model: the draft checkpoint (default: the pair's)")
    p.add_argument("--prompt-files", type=int, default=2,
                   help="with --model: held-out files to prompt from (a continuation and an edit each)")
    p.add_argument("--prompt-bytes", type=int, default=1024, help="with --model: bytes of each file in its prompts")
    p.add_argument("--mtp-k", type=int, nargs="+", default=None, metavar="K",
                   help="with --model: draft lengths of the loop+mtp runs, the target checkpoint's own MTP head "
                        "(generate(use_mtp=True, num_assistant_tokens=K)); default 1 2 3 4 5 where the checkpoint "
                        "has mtp.* weights (skipped, and said so, where it has none; named here, refused)")
    p.add_argument("--loop-only", action="store_true",
                   help="only transformers' baselines and the decode loop's runs (loop, loop+lookup; with --model "
                        "also loop+draft, loop+mtp), not transformers' loop on the converted model (ours*, graphs*, "
                        "and ours's single forwards)")
    p.add_argument("--kind", choices=list(KINDS), default="qwen3_next",
                   help="model class (ssm_spec.hf.tiny.KINDS): the *_moe kinds have expert layers in every layer; "
                        "the *_vl kinds are the vision-language classes, run on text prompts")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="model dtype")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="recurrent state dtype of the RecoverSSM cache")
    p.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {FULL['hidden']})")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers, every 4th full attention "
                                                            f"(default {FULL['layers']})")
    p.add_argument("--key-heads", type=int, default=None, help=f"GDN key heads (default {FULL['key_heads']})")
    p.add_argument("--value-heads", type=int, default=None,
                   help=f"GDN value heads (default {FULL['value_heads']})")
    p.add_argument("--head-dim", type=int, default=None, help=f"GDN head dim (default {FULL['head_dim']})")
    p.add_argument("--attn-heads", type=int, default=None,
                   help=f"attention query heads (default {FULL['attn_heads']})")
    p.add_argument("--kv-heads", type=int, default=None, help=f"attention KV heads (default {FULL['kv_heads']})")
    p.add_argument("--attn-head-dim", type=int, default=None,
                   help=f"attention head dim (default {FULL['attn_head_dim']})")
    p.add_argument("--intermediate", type=int, default=None, help=f"MLP width (default {FULL['intermediate']})")
    p.add_argument("--experts", type=int, default=None,
                   help=f"experts per layer, the *_moe kinds (default {FULL['experts']})")
    p.add_argument("--experts-per-token", type=int, default=None,
                   help=f"routed experts per token, the *_moe kinds (default {FULL['experts_per_token']})")
    p.add_argument("--moe-intermediate", type=int, default=None,
                   help=f"width of each expert and of the shared expert (default {FULL['moe_intermediate']})")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens every run generates (default {FULL['new_tokens']})")
    p.add_argument("--num-draft-tokens", type=int, default=5, help="prompt_lookup_num_tokens (k)")
    p.add_argument("--prompt-repeats", type=int, default=None,
                   help=f"times the sentence is repeated in the prompt (default {FULL['prompt_repeats']})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed generate calls per run, median "
                                                             f"(default {FULL['repeats']})")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens of each warm-up generate (default: --new-tokens; with --model on the "
                        f"CPU {DEMO_WARMUP_TOKENS}); shorter warm-ups can leave compilation in the timed calls")
    p.add_argument("--forward-reps", type=int, default=None,
                   help=f"timed single forwards per width, median (default {FULL['forward_reps']})")
    p.add_argument("--forward-warmup", type=int, default=3, help="untimed single forwards per width")
    p.add_argument("--no-hf-torch", dest="hf_torch", action="store_false",
                   help="skip the hf-torch baseline (the unconverted model on transformers' PyTorch reference "
                        "functions instead of fla-core's kernels)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="skip the runs with apply_recoverssm(model, cuda_graphs=True)")
    p.add_argument("--skip", nargs="+", default=[], choices=["hf_lookup", "hf_static"], metavar="RUN",
                   help="transformers' optional runs to leave out: hf_lookup, hf_static (recorded as skipped)")
    p.add_argument("--no-loop", dest="loop", action="store_false",
                   help="skip the runs through ssm-spec's decode loop (loop, loop+lookup)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="the decode loop's forwards through torch.compile: apply_recoverssm(compile=...) "
                        "'auto' (the library's default: compiled when the loop captures CUDA graphs), True, False; "
                        "the loop's rows and forward times are the loop's as run")
    p.add_argument("--batch", type=int, nargs="+", default=[1], metavar="B",
                   help="batch sizes of the decode-loop runs (rows of the same length, each a rotation of the "
                        "prompt; tokens/s counts every row's tokens): batch 1 is reported as loop / loop+lookup, "
                        "the others as loop@B / loop+lookup@B; the other runs are batch 1")
    p.add_argument("--hf-verify-forward", action="store_true",
                   help="also time a W = k + 1 forward of the unconverted model (state advancing; compiles "
                        "fla's chunked kernels for a cached short window: ~15 s more on a fresh H200)")
    p.add_argument("--seed", type=int, default=0, help="model weights seed")
    p.add_argument("--std", type=float, default=None,
                   help="std of the linear weights (default 0.2 * sqrt(64 / hidden): tiny_model's 0.2 at "
                        "hidden 64, scaled with the width)")
    p.add_argument("--embed-std", type=float, default=10.0, help="std of the embeddings (tiny_model's)")
    p.add_argument("--residual-scale", type=float, default=0.5,
                   help="scale of the mixers' and MLPs' output projections (tiny_model's)")
    add_out_args(p)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --quick for a smoke test)")
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cpu = torch.device(args.device).type == "cpu"
    if args.warmup_tokens is None:  # the whole length, but for a trained pair on the CPU
        args.warmup_tokens = DEMO_WARMUP_TOKENS if args.model is not None and cpu else args.new_tokens
    if args.std is None:
        args.std = 0.2 * math.sqrt(64 / args.hidden)
    if args.value_heads % args.key_heads:
        p.error("--value-heads must be a multiple of --key-heads")
    if args.attn_heads % args.kv_heads:
        p.error("--attn-heads must be a multiple of --kv-heads")
    if not 1 <= args.experts_per_token <= args.experts or args.moe_intermediate < 1:
        p.error("--experts-per-token must be in 1..--experts, --moe-intermediate >= 1")
    if min(args.batch) < 1:
        p.error("--batch: every size must be >= 1")
    if min(args.new_tokens, args.num_draft_tokens, args.repeats, args.forward_reps, args.warmup_tokens) < 1:
        p.error("--new-tokens, --num-draft-tokens, --repeats, --forward-reps, --warmup-tokens must be >= 1")
    if args.model is None and args.draft is not None:
        p.error("--draft needs --model (the random-weight runs draft by prompt lookup)")
    if args.model is None and args.mtp_k is not None:
        p.error("--mtp-k needs --model (the random-weight runs have no MTP head)")
    if args.loop_only and not args.loop:
        p.error("--loop-only and --no-loop leave nothing of ours to run")
    if args.model is not None:  # the trained pair and its prompts, checked before anything loads
        if min(args.prompt_files, args.prompt_bytes) < 1:
            p.error("--prompt-files and --prompt-bytes must be >= 1")
        if args.mtp_k is not None and min(args.mtp_k) < 1:
            p.error("--mtp-k: every draft length must be >= 1")
        try:
            target, _, manifest = demo_paths(args.model, args.draft)
            held_out_prompts(manifest, args.prompt_files, args.prompt_bytes)
        except ValueError as exc:
            p.error(str(exc))
        if args.mtp_k is not None:
            why = mtp_missing(target) if args.loop else "--no-loop (the MTP head drafts in the decode loop)"
            if why:
                p.error(f"--mtp-k: --model {args.model} cannot draft with an MTP head: {why}")
        else:
            args.mtp_k = [1, 2, 3, 4, 5]
    # a trained pair's CPU run is a measurement (the demo pair's committed CPU numbers); random weights on a CPU are a smoke run
    resolve_out_dir(p, args, smoke=args.quick or (cpu and args.model is None))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.model is not None:  # a trained pair on held-out code prompts
        stem = f"hf_generate_demo_{args.dtype}"
        res = {**run_demo(args, progress=PartialResults(args.out_dir, stem)),
               "environment": environment(torch.device(args.device))}
        print_demo(res)
        write_results(res, args.out_dir, stem, save_demo_plot)
        return res
    res = run(args, progress=PartialResults(args.out_dir, result_name(args.kind, args.dtype)))
    print_table(res)
    write_results(res, args.out_dir, result_name(args.kind, args.dtype), save_plot)
    return res


if __name__ == "__main__":
    main()
