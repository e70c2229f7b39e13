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
   skips them.

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
run), ``--out-dir DIR`` writes DIR. The output's first lines say where.

Usage::

    python benchmarks/bench_hf_generate.py --save              # cuda, bf16, 256 new tokens, committed
    python benchmarks/bench_hf_generate.py --dtype float32
    python benchmarks/bench_hf_generate.py --device cpu --quick
    python benchmarks/bench_hf_generate.py --no-hf-torch       # skip the PyTorch-reference baseline
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _results import HelpFormatter, add_out_args, device_name, pyplot, resolve_out_dir, write_results
from timing import Clock, Phases, timing_spread

from ssm_spec.hf.kernels import hf_reference_kernels
from ssm_spec.hf.tiny import KINDS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUNS = ("hf", "hf-torch", "hf_lookup", "hf_static", "ours", "ours+lookup", "graphs", "graphs+lookup")
RUN_TITLES = {
    "hf": "(1) plain generate, unconverted model (transformers' GDN path, fla-core where installed)",
    "hf-torch": "(2) plain generate, unconverted model (transformers' PyTorch reference functions)",
    "hf_lookup": "transformers' own prompt lookup on the unconverted model (releases that run it: 5.25+)",
    "hf_static": "plain generate, unconverted model, cache_implementation='static' (compiled on CUDA)",
    "ours": "(3) plain generate, converted model (RecoverSSMCache)",
    "ours+lookup": "(4) prompt-lookup generate, converted model",
    "graphs": "(5) plain generate, converted model, forwards replayed as CUDA graphs",
    "graphs+lookup": "(6) prompt-lookup generate, converted model, forwards replayed as CUDA graphs",
}
#: The baselines the speedups are reported over.
BASELINES = ("hf", "hf-torch")
SENTENCE = "The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun. "

#: Widths of the default (H200) model and of ``--quick``.
#: ``--model``'s default warm-up on the CPU, where nothing compiles: the pair's prompts make
#: 7 runs x 4 prompts x (warm-up + 2 timed calls) of eager generate. On CUDA the warm-up is the
#: whole length (as for the random-weight kinds): a 32-token warm-up there left the first timed
#: call of several runs 2-4.5x slower than the second (H200, 2026-12-02).
DEMO_WARMUP_TOKENS = 32
FULL = dict(hidden=2048, layers=8, key_heads=16, value_heads=32, head_dim=128, attn_heads=16,
            kv_heads=2, attn_head_dim=128, intermediate=5632, new_tokens=256, repeats=2,
            forward_reps=20, prompt_repeats=4, experts=64, experts_per_token=8, moe_intermediate=512)
QUICK = dict(hidden=64, layers=4, key_heads=2, value_heads=4, head_dim=16, attn_heads=4,
             kv_heads=2, attn_head_dim=16, intermediate=128, new_tokens=32, repeats=1,
             forward_reps=5, prompt_repeats=3, experts=4, experts_per_token=2, moe_intermediate=32)


def is_moe(kind: str) -> bool:
    """Whether ``kind`` has expert layers (``qwen3_next_moe``, ``qwen3_5_moe``, ``qwen3_5_moe_vl``)."""
    return "moe" in kind


def result_name(kind: str, dtype: str) -> str:
    """The results file's stem: ``hf_generate_<dtype>`` for the dense Qwen3-Next (the first
    benchmark's name, kept), ``hf_generate_<kind>_<dtype>`` for every other kind."""
    return f"hf_generate_{dtype}" if kind == "qwen3_next" else f"hf_generate_{kind}_{dtype}"


# ----------------------------------------------------------------------------- helpers


def output_cache(out):
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (``None`` when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def _implementation(fn):
    """The function a transformers fallback wrapper dispatches to (its ``implementation`` free
    variable, through ``__wrapped__`` chains), or ``fn`` itself."""
    seen = 0
    while fn is not None and seen < 8:
        code = getattr(fn, "__code__", None)
        cells = dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}
        if "implementation" in cells:
            try:
                return cells["implementation"].cell_contents
            except ValueError:  # an empty cell
                return fn
        if getattr(fn, "__wrapped__", None) is None:
            return fn
        fn, seen = fn.__wrapped__, seen + 1
    return fn


def kernel_sources(model) -> dict:
    """Best effort: the module each GDN kernel of the unconverted model comes from (fla,
    causal_conv1d, or transformers' torch fallback), read from the layer's attributes or the
    modeling module's functions, unwrapping transformers' hub/fallback wrappers."""
    layer = next((m for m in model.modules() if hasattr(m, "A_log")), None)
    if layer is None:
        return {}
    modeling = sys.modules.get(type(layer).__module__)
    out = {}
    for name in ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        fn = None
        for candidate in (name, f"torch_{name}"):
            fn = getattr(layer, candidate, None) or getattr(modeling, candidate, None)
            if fn is not None:
                break
        if fn is None:
            continue
        impl = _implementation(fn)
        out[name] = f"{getattr(impl, '__module__', None) or type(impl).__name__}.{getattr(impl, '__name__', '?')}"
    fast = getattr(modeling, "is_fast_path_available", None)
    if fast is not None:
        out["is_fast_path_available"] = bool(fast)
    return out


def environment(device: torch.device) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "cuda": torch.version.cuda,
        "fla_core": package_version("fla-core") or package_version("flash-linear-attention"),
        "fla_importable": importlib.util.find_spec("fla") is not None,
        "causal_conv1d_importable": importlib.util.find_spec("causal_conv1d") is not None,
        "triton": package_version("triton"),
    }
    env["device"] = device_name(device)
    if device.type == "cuda":
        env["driver_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


# ----------------------------------------------------------------------------- measurements


def gen_kwargs(n: int, attention_mask: torch.Tensor) -> dict:
    from ssm_spec.hf import ByteTokenizer
    return dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=ByteTokenizer.pad_token_id, eos_token_id=ByteTokenizer.eos_token_id,
                temperature=None, top_p=None, top_k=None)


def timed_generate(model, ids, clock, phases, name, *, new_tokens, warmup_tokens, repeats,
                   make_extra=None) -> dict:
    """Median wall time of ``repeats`` greedy ``generate`` calls (after one warm-up call of
    ``warmup_tokens``); ``make_extra()`` gives per-call kwargs (a fresh cache)."""
    mask = torch.ones_like(ids)
    extra = make_extra() if make_extra else {}
    with phases(f"{name} warm-up"):
        model.generate(ids, **gen_kwargs(warmup_tokens, mask), **extra)
    times, seq, last_extra = [], None, None
    for _ in range(repeats):
        last_extra = make_extra() if make_extra else {}
        t0 = clock()
        out = model.generate(ids, **gen_kwargs(new_tokens, mask), **last_extra)
        times.append(clock() - t0)
        new = out[0, ids.shape[1]:].tolist()
        if seq is not None and new != seq:
            print("warning: repeated generate calls gave different tokens", file=sys.stderr)
        seq = new
    med = statistics.median(times)
    phases.seconds[f"{name} timed"] = sum(times)
    return {"tokens": seq, "new_tokens": len(seq), "times_s": times, "time_s": med,
            "times_spread": timing_spread(name, times), "tokens_per_s": len(seq) / med, "extra": last_extra}


def timed_generate_hf_torch(model, ids, clock, phases, hf_kernels: dict, **common) -> tuple[dict, dict]:
    """``timed_generate`` of the unconverted model inside :func:`ssm_spec.hf.kernels.hf_reference_kernels`, and what it
    ran on: the kernels (``kernel_sources`` inside the block), the functions replaced, and
    whether that is ``hf``'s path already (the same kernels: nothing but transformers' dispatch
    wrapper was taken away)."""
    with hf_reference_kernels() as patched:
        kernels = kernel_sources(model)
        result = timed_generate(model, ids, clock, phases, "hf-torch", **common)
    return result, {"kernels": kernels, "patched": patched, "same_as_hf": kernels == hf_kernels}


def acceptance_summary(stats) -> dict:
    """The JSON form of a cache's :class:`~ssm_spec.hf.AcceptanceStats`."""
    return {"rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
            "mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate,
            "position_rates": stats.position_rates}


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``[L, V]`` fp32 logits of one forward over ``ids [1, L]`` from an empty cache (with a
    cache, so transformers runs the same kernel variants as in a prompt prefill: fla's
    chunked kernels specialise on storing the final state)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return out.logits[0].float()


def gap_at(logits: torch.Tensor, pos: int, tok_a: int, tok_b: int) -> dict:
    row = logits[pos]
    top = torch.topk(row, 2)
    return {"top1_minus_top2": float(top.values[0] - top.values[1]),
            "top1_token": int(top.indices[0]),
            "logit_a_minus_b": float(row[tok_a] - row[tok_b])}


def time_forwards(model, prompt, clock, widths, reps, warmup, *, rollback: bool, make_cache, key) -> dict:
    """Median time of a forward of ``W`` tokens after a prefill of ``prompt``, per ``W``.

    ``rollback``: a ``RecoverSSMCache`` cropped by ``W`` after every forward (the state stays
    the prompt's; crop timed separately). Otherwise transformers' cache, advancing. Each forward
    gets a full-length all-ones ``attention_mask``, as ``generate`` passes one."""
    res = {}
    seen = prompt.shape[1]

    def ones(n):
        return torch.ones(1, n, dtype=torch.long, device=prompt.device)

    def positions(start, n):  # explicit, as generate passes them (the vision-language class needs them)
        return torch.arange(start, start + n, device=prompt.device)[None]

    with torch.no_grad():
        cache = make_cache()
        kw = {key: cache} if cache is not None else {}
        out = model(input_ids=prompt, attention_mask=ones(seen), position_ids=positions(0, seen), use_cache=True,
                    **kw)
        if cache is None:
            cache = output_cache(out)
        if rollback:
            cache.crop(0)  # commit the pending prompt tokens
        for W in widths:
            x = prompt[:, -W:]
            fwd, crop = [], []
            for i in range(warmup + reps):
                mask = ones(seen + W)
                t0 = clock()
                model(input_ids=x, attention_mask=mask, position_ids=positions(seen, W), use_cache=True,
                      **{key: cache})
                t1 = clock()
                if rollback:
                    cache.crop(-W)
                else:
                    seen += W
                t2 = clock()
                if i >= warmup:
                    fwd.append(t1 - t0)
                    crop.append(t2 - t1)
            entry = {"forward_ms": 1e3 * statistics.median(fwd), "forward_ms_all": [1e3 * t for t in fwd]}
            if rollback:
                entry["crop_ms"] = 1e3 * statistics.median(crop)
                entry["forward_plus_crop_ms"] = 1e3 * statistics.median([a + b for a, b in zip(fwd, crop)])
            res[str(W)] = entry
    return res


def ratio(tps: dict, a: str, b: str) -> float | None:
    """``tps[a] / tps[b]``, ``None`` where either run was skipped."""
    return tps[a] / tps[b] if a in tps and b in tps else None


def model_config(args) -> tuple[dict, dict]:
    """``(config, init)`` keyword arguments of :func:`ssm_spec.hf.tiny_model` for the width and
    weight-scale options (``--hidden``, ``--layers``, ..., ``--std``, ``--embed-std``,
    ``--residual-scale``; the expert widths for the ``*_moe`` kinds)."""
    cfg = dict(hidden_size=args.hidden, num_layers=args.layers, linear_num_key_heads=args.key_heads,
               linear_num_value_heads=args.value_heads, linear_head_dim=args.head_dim,
               num_attention_heads=args.attn_heads, num_key_value_heads=args.kv_heads,
               head_dim=args.attn_head_dim, intermediate_size=args.intermediate)
    if is_moe(args.kind):
        cfg.update(num_experts=args.experts, num_experts_per_tok=args.experts_per_token,
                   moe_intermediate_size=args.moe_intermediate, shared_expert_intermediate_size=args.moe_intermediate)
    return cfg, dict(std=args.std, embed_std=args.embed_std, residual_scale=args.residual_scale)


def run(args) -> dict:
    from ssm_spec.hf import ByteTokenizer, RecoverSSMCache, apply_recoverssm, tiny_model
    from ssm_spec.hf import cache_kwarg, kept_cache

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dtype, state_dtype = DTYPES[args.dtype], DTYPES[args.state_dtype]
    clock = Clock(device)
    phases = Phases(clock)
    k = args.num_draft_tokens
    N = args.new_tokens
    t_start = time.perf_counter()

    cfg, init = model_config(args)
    with phases("build"):
        model = tiny_model(args.kind, seed=args.seed, dtype=dtype, **init, **cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.kind} {n_params / 1e6:.1f}M params, {args.dtype}, std {args.std:.4g}, "
          f"built in {phases.seconds['build']:.1f} s", flush=True)

    tok = ByteTokenizer()
    prompt = torch.tensor([tok.encode(SENTENCE * args.prompt_repeats)], device=device)
    P = prompt.shape[1]
    kernels = kernel_sources(model)
    common = dict(new_tokens=N, warmup_tokens=args.warmup_tokens, repeats=args.repeats)

    # (1) transformers' own path, (2) its PyTorch reference functions, before the in-place conversion.
    runs = {}
    runs["hf"] = timed_generate(model, prompt, clock, phases, "hf", **common)
    print(f"hf:          {runs['hf']['tokens_per_s']:8.1f} tok/s", flush=True)
    hf_torch = {"kernels": None, "patched": None, "same_as_hf": None}
    if args.hf_torch:
        runs["hf-torch"], hf_torch = timed_generate_hf_torch(model, prompt, clock, phases, kernels, **common)
        same = f" (the same kernels as hf, {same_kernels_why(kernels)})" if hf_torch["same_as_hf"] else ""
        print(f"hf-torch:    {runs['hf-torch']['tokens_per_s']:8.1f} tok/s{same}", flush=True)
    skipped = {}
    for name, extra in (("hf_lookup", {"prompt_lookup_num_tokens": k}), ("hf_static", {"cache_implementation": "static"})):
        try:
            runs[name] = timed_generate(model, prompt, clock, phases, name, make_extra=lambda extra=extra: dict(extra),
                                        **common)
            print(f"{name + ':':<12} {runs[name]['tokens_per_s']:8.1f} tok/s", flush=True)
        except Exception as exc:  # a release without the feature: recorded, never fatal
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(f"{name + ':':<12} skipped ({skipped[name]})", flush=True)
    plain_seq = prompt[0].tolist() + runs["hf"]["tokens"]
    with phases("hf logits"):
        plain_logits = full_logits(model, torch.tensor([plain_seq], device=device))
    with phases("hf forwards"):
        try:
            hf_widths = [1, k + 1] if args.hf_verify_forward else [1]
            hf_forwards = time_forwards(model, prompt, clock, hf_widths, args.forward_reps, args.forward_warmup,
                                        rollback=False, make_cache=lambda: None, key=cache_kwarg(model))
        except Exception as exc:  # informative only; never lose the main numbers
            hf_forwards = {"error": f"{type(exc).__name__}: {exc}"}

    # (3), (4): the same weights, converted in place.
    with phases("convert"):
        apply_recoverssm(model, state_dtype=state_dtype)
    key = cache_kwarg(model)
    runs["ours"] = timed_generate(model, prompt, clock, phases, "ours", **common)
    print(f"ours:        {runs['ours']['tokens_per_s']:8.1f} tok/s", flush=True)

    def lookup_cache():
        cache = RecoverSSMCache(model, max_pending=k + 1, state_dtype=state_dtype)
        return {"prompt_lookup_num_tokens": k, key: cache}

    runs["ours+lookup"] = timed_generate(model, prompt, clock, phases, "lookup", make_extra=lookup_cache, **common)
    print(f"ours+lookup: {runs['ours+lookup']['tokens_per_s']:8.1f} tok/s", flush=True)
    acceptance = acceptance_summary(runs["ours+lookup"]["extra"][key].stats)

    graphs = None
    if args.graphs:
        apply_recoverssm(model, cuda_graphs=True)
        runs["graphs"] = timed_generate(model, prompt, clock, phases, "graphs", **common)
        print(f"graphs:      {runs['graphs']['tokens_per_s']:8.1f} tok/s", flush=True)
        runs["graphs+lookup"] = timed_generate(model, prompt, clock, phases, "graphs+lookup",
                                               make_extra=lambda: {"prompt_lookup_num_tokens": k}, **common)
        print(f"graphs+lookup: {runs['graphs+lookup']['tokens_per_s']:6.1f} tok/s", flush=True)
        gcache = kept_cache(model)
        gf = gcache.graphed
        graphs = {"captured": len(gf.graphs), "replays": gf.replays, "eager_forwards": gf.eager_forwards,
                  "failed": gf.failed, "kv_capacity": gcache.kv_capacity,
                  "acceptance": acceptance_summary(gcache.stats)}
        apply_recoverssm(model, cuda_graphs=False)

    with phases("ours forwards"):
        ours_forwards = time_forwards(
            model, prompt, clock, [1, k + 1], args.forward_reps, args.forward_warmup, rollback=True, key=key,
            make_cache=lambda: RecoverSSMCache(model, max_pending=k + 1, state_dtype=state_dtype))

    # Agreement of the token sequences.
    agreement = {}
    pairs = [("hf", "hf-torch")] if "hf-torch" in runs else []
    pairs += [("hf", name) for name in ("hf_lookup", "hf_static") if name in runs]
    pairs += [("hf", "ours"), ("hf", "ours+lookup"), ("ours", "ours+lookup")]
    if graphs is not None:
        pairs += [("hf", "graphs"), ("hf", "graphs+lookup"), ("ours", "graphs"), ("ours+lookup", "graphs+lookup")]
    with phases("agreement"):
        for a, b in pairs:
            sa, sb = runs[a]["tokens"], runs[b]["tokens"]
            d = first_diff(sa, sb)
            entry = {"equal": d is None, "first_diff": d}
            if d is not None and d < min(len(sa), len(sb)):  # else one is a prefix of the other (an end of sequence)
                ta, tb = sa[d], sb[d]
                entry.update({"token_a": ta, "token_b": tb})
                if sa[:d] == runs["hf"]["tokens"][:d]:  # the prefix is hf's: the unconverted model's logits
                    entry.update(gap_at(plain_logits, P + d - 1, ta, tb), gap_model="unconverted")
                else:  # ours and ours+lookup parted from hf earlier: the converted model on ours' prefix
                    with torch.no_grad():
                        ids = torch.tensor([prompt[0].tolist() + sa[:d]], device=device)
                    logits = full_logits(model, ids)
                    entry.update(gap_at(logits, P + d - 1, ta, tb), gap_model="converted")
            agreement[f"{a} vs {b}"] = entry
    top2 = torch.topk(plain_logits[P - 1:P - 1 + N], 2).values
    gen_gaps = (top2[:, 0] - top2[:, 1]).tolist()

    for r in runs.values():
        r.pop("extra", None)
    tps = {name: runs[name]["tokens_per_s"] for name in RUNS if name in runs}
    fw1, fwW = ours_forwards["1"], ours_forwards[str(k + 1)]
    res = {
        "environment": environment(device),
        "config": {"kind": args.kind, **cfg, **init, "dtype": args.dtype, "state_dtype": args.state_dtype,
                   "params": n_params, "seed": args.seed, "prompt_len": P, "prompt_repeats": args.prompt_repeats,
                   "new_tokens": N, "num_draft_tokens": k, "repeats": args.repeats,
                   "warmup_tokens": args.warmup_tokens, "forward_reps": args.forward_reps, "quick": args.quick,
                   "batch": 1, "greedy": True, "hf_torch": args.hf_torch, "graphs": args.graphs},
        "hf_kernels": kernels,
        "hf_torch_kernels": hf_torch["kernels"],
        "hf_torch_patched": hf_torch["patched"],
        "hf_torch_same_as_hf": hf_torch["same_as_hf"],
        "runs": runs,
        "skipped": skipped,
        "tokens_per_s": tps,
        "speedup_lookup_over_hf": tps["ours+lookup"] / tps["hf"],
        "speedup_ours_over_hf": tps["ours"] / tps["hf"],
        "speedup_lookup_over_ours": tps["ours+lookup"] / tps["ours"],
        "speedup_lookup_over_hf_torch": ratio(tps, "ours+lookup", "hf-torch"),
        "speedup_ours_over_hf_torch": ratio(tps, "ours", "hf-torch"),
        "speedup_hf_over_hf_torch": ratio(tps, "hf", "hf-torch"),
        "acceptance": acceptance,
        "graphs": graphs,
        "speedup_graphs_lookup_over_hf": ratio(tps, "graphs+lookup", "hf"),
        "speedup_graphs_over_hf": ratio(tps, "graphs", "hf"),
        "speedup_graphs_lookup_over_graphs": ratio(tps, "graphs+lookup", "graphs"),
        "speedup_graphs_lookup_over_hf_torch": ratio(tps, "graphs+lookup", "hf-torch"),
        "speedup_graphs_over_hf_static": ratio(tps, "graphs", "hf_static"),
        "speedup_graphs_lookup_over_hf_lookup": ratio(tps, "graphs+lookup", "hf_lookup"),
        "agreement": agreement,
        "plain_min_logit_gap": min(gen_gaps) + 0.0 if gen_gaps else None,
        "plain_logit_gaps": gen_gaps,
        "forwards": {"ours": ours_forwards, "hf": hf_forwards,
                     "ours_verify_over_decode": fwW["forward_ms"] / fw1["forward_ms"],
                     "ours_verify_over_decode_with_crop": fwW["forward_plus_crop_ms"] / fw1["forward_plus_crop_ms"]},
        "phases_s": phases.seconds,
        "total_s": time.perf_counter() - t_start,
    }
    if str(k + 1) in hf_forwards:
        res["forwards"]["hf_verify_over_decode"] = (hf_forwards[str(k + 1)]["forward_ms"]
                                                    / hf_forwards["1"]["forward_ms"])
    return res


# ----------------------------------------------------------------------------- output


def print_table(res: dict) -> None:
    env, c = res["environment"], res["config"]
    k = c["num_draft_tokens"]
    print()
    print(f"{env['device']}  torch {env['torch']}  transformers {env['transformers']}  "
          f"fla-core {env['fla_core'] or '-'}")
    print(f"{c['kind']} hidden={c['hidden_size']} layers={c['num_layers']} GDN {c['linear_num_key_heads']}k/"
          f"{c['linear_num_value_heads']}v x {c['linear_head_dim']}  attn {c['num_attention_heads']}q/"
          f"{c['num_key_value_heads']}kv x {c['head_dim']}  "
          + (f"experts {c['num_experts']} x {c['moe_intermediate_size']} top-{c['num_experts_per_tok']} + shared  "
             if "num_experts" in c else f"mlp {c['intermediate_size']}  ")
          + f"({c['params'] / 1e6:.0f}M)  {c['dtype']}, state {c['state_dtype']}")
    print(f"prompt {c['prompt_len']} tokens, {c['new_tokens']} new tokens, k={k} drafts, batch 1, greedy, "
          f"median of {c['repeats']}")
    print_kernels(res)
    tps = res["tokens_per_s"]
    head = (f"{'run':<13} | {'tok/s':>8} {'time s':>8} | " + " ".join(f"{'vs ' + b:>11}" for b in BASELINES)
            + f" | {'same as hf':>11}")
    print(head)
    print("-" * len(head))
    for name in RUNS:
        if name not in res["runs"]:
            why = res.get("skipped", {}).get(name) or ("--no-graphs" if "graphs" in name else "--no-hf-torch")
            print(f"{name:<13} | skipped ({why})")
            continue
        r = res["runs"][name]
        if name == "hf":
            same = "-"
        else:
            a = res["agreement"][f"hf vs {name}"]
            same = "yes" if a["equal"] else f"no @ {a['first_diff']}"
        vs = " ".join(f"{tps[name] / tps[b]:10.2f}x" if b in tps else f"{'-':>11}" for b in BASELINES)
        print(f"{name:<13} | {r['tokens_per_s']:8.1f} {r['time_s']:8.3f} | {vs} | {same:>11}")
    acc = res["acceptance"]
    print(f"lookup: {acc['rounds']} rounds, mean accepted length {acc['mean_accepted_length']:.2f}, "
          f"acceptance rate {acc['acceptance_rate']:.2f}, per position "
          + " ".join(f"{x:.2f}" for x in acc["position_rates"]))
    g = res.get("graphs")
    if g:
        ga = g["acceptance"]
        print(f"graphs: {g['captured']} graphs captured, {g['replays']} replays, {g['eager_forwards']} eager forwards"
              f"{', capture failed: ' + g['failed'] if g['failed'] else ''}; graphs+lookup: {ga['rounds']} rounds, "
              f"mean accepted length {ga['mean_accepted_length']:.2f}")
    for pair, a in res["agreement"].items():
        if not a["equal"] and "token_a" not in a:
            print(f"  {pair}: the shorter run is a prefix of the other (it ended at new token {a['first_diff']})")
        elif not a["equal"]:
            print(f"  {pair}: first difference at new token {a['first_diff']} "
                  f"({a['token_a']} vs {a['token_b']}); {a['gap_model']} model there: top1-top2 "
                  f"{a['top1_minus_top2']:.4g}, logit(a)-logit(b) {a['logit_a_minus_b']:.4g}")
    if res["plain_min_logit_gap"] is not None:
        print(f"  smallest top1-top2 logit gap along hf: {res['plain_min_logit_gap']:.4g}")
    fw = res["forwards"]
    print(f"single forwards, warm cache (median ms): W=1 decode, W={k + 1} verify")
    o1, oW = fw["ours"]["1"], fw["ours"][str(k + 1)]
    print(f"  ours: fwd {o1['forward_ms']:.3f} / {oW['forward_ms']:.3f}  (x{fw['ours_verify_over_decode']:.2f}); "
          f"crop {o1['crop_ms']:.3f} / {oW['crop_ms']:.3f}; fwd+crop x{fw['ours_verify_over_decode_with_crop']:.2f}")
    if "error" in fw["hf"]:
        print(f"  hf:   {fw['hf']['error']}")
    else:
        h = " / ".join(f"{fw['hf'][w]['forward_ms']:.3f}" for w in fw["hf"])
        ratio = f"x{fw['hf_verify_over_decode']:.2f}; " if "hf_verify_over_decode" in fw else ""
        print(f"  hf:   fwd {h}  ({ratio}transformers' cache, state advancing)")
    print("wall time (s): " + ", ".join(f"{n} {t:.1f}" for n, t in res["phases_s"].items())
          + f"; total {res['total_s']:.0f}")
    torch_part = ""
    if res["speedup_lookup_over_hf_torch"] is not None:
        torch_part = (f"; over hf-torch: ours+lookup {res['speedup_lookup_over_hf_torch']:.2f}x, "
                      f"ours {res['speedup_ours_over_hf_torch']:.2f}x, hf {res['speedup_hf_over_hf_torch']:.2f}x")
    print(f"speedup over hf: ours+lookup {res['speedup_lookup_over_hf']:.2f}x, ours {res['speedup_ours_over_hf']:.2f}x"
          f"{torch_part}; ours+lookup over ours {res['speedup_lookup_over_ours']:.2f}x")
    if res.get("speedup_graphs_lookup_over_hf") is not None:
        print(f"speedup over hf: graphs+lookup {res['speedup_graphs_lookup_over_hf']:.2f}x, graphs "
              f"{res['speedup_graphs_over_hf']:.2f}x; graphs+lookup over graphs "
              f"{res['speedup_graphs_lookup_over_graphs']:.2f}x")


def same_kernels_why(kernels: dict | None) -> str:
    """Why ``hf-torch`` ran ``hf``'s kernels (``kernels``: name -> source, as ``kernel_sources``
    reports them): fla-core's left bound (the family was not unwrapped), or no fla-core at all."""
    fla = any(str(v).startswith("fla.") for v in (kernels or {}).values())
    return ("fla-core's: this family's functions were not unwrapped" if fla
            else "transformers' PyTorch functions; no fla-core kernels bound")


def print_kernels(res: dict) -> None:
    """The kernels each baseline ran on (and whether ``hf-torch`` is ``hf``'s path)."""
    if res["hf_kernels"]:
        print("hf kernels: " + ", ".join(f"{n}={s}" for n, s in res["hf_kernels"].items()))
    if res["hf_torch_same_as_hf"]:
        print(f"hf-torch kernels: the same as hf ({same_kernels_why(res['hf_kernels'])}), so hf-torch repeats "
              "hf's path")
    elif res["hf_torch_kernels"]:
        print("hf-torch kernels: " + ", ".join(f"{n}={s}" for n, s in res["hf_torch_kernels"].items()))


def save_plot(res: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    c, k = res["config"], res["config"]["num_draft_tokens"]
    fig, (ax_g, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    tps = res["tokens_per_s"]
    names = [n for n in RUNS if n in tps]
    labels = {"hf": "hf generate", "hf-torch": "hf generate\n(torch reference)",
              "hf_lookup": f"hf's own lookup k={k}", "hf_static": "hf static cache\n(compiled)", "ours": "ours generate",
              "ours+lookup": f"ours + lookup k={k}", "graphs": "ours generate\n(CUDA graphs)",
              "graphs+lookup": f"ours + lookup k={k}\n(CUDA graphs)"}
    colors = {"hf": "tab:gray", "hf-torch": "silver", "hf_lookup": "tab:brown", "hf_static": "tab:red", "ours": "tab:blue", "ours+lookup": "tab:green",
              "graphs": "tab:purple", "graphs+lookup": "tab:olive"}
    vals = [tps[n] for n in names]
    bars = ax_g.bar([labels[n] for n in names], vals, color=[colors[n] for n in names])
    for bar, v in zip(bars, vals):
        vs = "\n".join(f"{v / tps[b]:.2f}x {b}" for b in BASELINES if b in tps)
        ax_g.annotate(f"{v:.0f}\n{vs}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax_g.set(ylabel="tokens / s", title=f"generate, {c['new_tokens']} new tokens, batch 1")
    ax_g.margins(y=0.2)
    ax_g.tick_params(axis="x", labelsize=7, labelrotation=30)

    fw = res["forwards"]
    widths = ["1", str(k + 1)]
    x = range(len(widths))
    series = [("ours fwd", [fw["ours"][w]["forward_ms"] for w in widths]),
              ("ours crop", [fw["ours"][w]["crop_ms"] for w in widths])]
    if "error" not in fw["hf"]:
        series.append(("hf fwd", [fw["hf"][w]["forward_ms"] if w in fw["hf"] else 0.0 for w in widths]))
    n = len(series)
    for i, (label, ys) in enumerate(series):
        ax_f.bar([xi + (i - (n - 1) / 2) * 0.8 / n for xi in x], ys, width=0.8 / n, label=label)
    ax_f.set_xticks(list(x), [f"W={w}" for w in widths])
    ax_f.set(ylabel="median ms", title="one forward, warm cache")
    ax_f.legend(fontsize=8)
    for ax in (ax_g, ax_f):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{res['environment']['device']}: {c['kind']} {c['params'] / 1e6:.0f}M, {c['dtype']}; "
                 f"mean accepted length {res['acceptance']['mean_accepted_length']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
    if min(args.new_tokens, args.num_draft_tokens, args.repeats, args.forward_reps, args.warmup_tokens) < 1:
        p.error("--new-tokens, --num-draft-tokens, --repeats, --forward-reps, --warmup-tokens must be >= 1")
    if args.model is None and args.draft is not None:
        p.error("--draft needs --model (the random-weight runs draft by prompt lookup)")
    if args.model is not None:  # the trained pair and its prompts, checked before anything loads
        from hf_demo import demo_paths, held_out_prompts

        if min(args.prompt_files, args.prompt_bytes) < 1:
            p.error("--prompt-files and --prompt-bytes must be >= 1")
        try:
            held_out_prompts(demo_paths(args.model, args.draft)[2], args.prompt_files, args.prompt_bytes)
        except ValueError as exc:
            p.error(str(exc))
    # a trained pair's CPU run is a measurement (the issue asks for CPU numbers); random weights on a CPU are a smoke run
    resolve_out_dir(p, args, smoke=args.quick or (cpu and args.model is None))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.model is not None:  # a trained pair on held-out code prompts
        from hf_demo import print_demo, run_demo, save_demo_plot

        res = {**run_demo(args), "environment": environment(torch.device(args.device))}
        print_demo(res)
        write_results(res, args.out_dir, f"hf_generate_demo_{args.dtype}", save_demo_plot)
        return res
    res = run(args)
    print_table(res)
    write_results(res, args.out_dir, result_name(args.kind, args.dtype), save_plot)
    return res


if __name__ == "__main__":
    main()
