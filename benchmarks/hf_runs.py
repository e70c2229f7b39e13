"""What ``bench_hf_generate.py`` measures on a random-weight model: timed greedy ``generate`` calls
(transformers' paths, then the converted model plain, with prompt lookup and graphed), timed
single forwards with a warm cache, and the run that takes them all and assembles the results."""

from __future__ import annotations

import statistics
import sys
import time

import torch
from hf_agreement import full_logits, token_agreement
from hf_environment import environment, kernel_sources, same_kernels_why
from hf_loop_runs import loop_runs
from timing import Clock, Phases, timing_spread

from ssm_spec.hf.kernels import hf_reference_kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUNS = ("hf", "hf-torch", "hf_lookup", "hf_static", "ours", "ours+lookup", "graphs", "graphs+lookup", "loop",
        "loop+lookup")
RUN_TITLES = {
    "hf": "(1) plain generate, unconverted model (transformers' GDN path, fla-core where installed)",
    "hf-torch": "(2) plain generate, unconverted model (transformers' PyTorch reference functions)",
    "hf_lookup": "transformers' own prompt lookup on the unconverted model (releases that run it: 5.25+)",
    "hf_static": "plain generate, unconverted model, cache_implementation='static' (compiled on CUDA)",
    "ours": "(3) plain generate, converted model (RecoverSSMCache)",
    "ours+lookup": "(4) prompt-lookup generate, converted model",
    "graphs": "(5) plain generate, converted model, forwards replayed as CUDA graphs",
    "graphs+lookup": "(6) prompt-lookup generate, converted model, forwards replayed as CUDA graphs",
    "loop": "(7) plain generate, converted model, ssm-spec's decode loop (rounds captured as CUDA graphs)",
    "loop+lookup": "(8) prompt-lookup generate, converted model, ssm-spec's decode loop",
}
SENTENCE = "The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun. "


def is_moe(kind: str) -> bool:
    """Whether ``kind`` has expert layers (``qwen3_next_moe``, ``qwen3_5_moe``, ``qwen3_5_moe_vl``)."""
    return "moe" in kind


def output_cache(out):
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


def gen_kwargs(n: int, attention_mask: torch.Tensor) -> dict:
    from ssm_spec.hf import ByteTokenizer
    return dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=ByteTokenizer.pad_token_id, eos_token_id=ByteTokenizer.eos_token_id,
                temperature=None, top_p=None, top_k=None)


def timed_generate(model, ids, clock, phases, name, *, new_tokens, warmup_tokens, repeats,
                   make_extra=None) -> dict:
    """Median wall time of ``repeats`` greedy ``generate`` calls on ``ids [B, P]`` (after one
    warm-up call of ``warmup_tokens``); ``make_extra()`` gives per-call kwargs (a fresh cache).
    ``tokens`` are row 0's new tokens; ``tokens_per_s`` counts every row's."""
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
        rows = out.shape[0]
        if seq is not None and new != seq:
            print("warning: repeated generate calls gave different tokens", file=sys.stderr)
        seq = new
    med = statistics.median(times)
    phases.seconds[f"{name} timed"] = sum(times)
    return {"tokens": seq, "new_tokens": len(seq), "rows": rows, "times_s": times, "time_s": med,
            "times_spread": timing_spread(name, times), "tokens_per_s": rows * len(seq) / med, "extra": last_extra}


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


def device_model(args, device):
    """The model of the width options drawn directly on ``device`` (seconds on a GPU, where the
    CPU draw of ``run`` takes a minute at 3.6 B; its weights differ from the CPU draw's), with a
    line saying what was built."""
    from ssm_spec.hf import tiny_model

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    cfg, init = model_config(args)
    t0 = time.perf_counter()
    model = tiny_model(args.kind, seed=args.seed, dtype=dtype, device=device, **init, **cfg)
    print(f"model {args.kind} {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params {args.dtype}, "
          f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    return model


def run(args, progress=None) -> dict:
    """Build the model of ``args`` and take every measurement of ``bench_hf_generate.py``'s list
    (transformers' runs before the in-place conversion, ours after it); returns the results dict.
    ``progress`` (a :class:`_results.PartialResults`, or None) is given the config, each run's
    tokens/s and the loop's section as they are measured."""
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
        model = tiny_model(args.kind, seed=args.seed, dtype=dtype, **init, **cfg).to(device)  # CPU-drawn: the committed results' weights
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.kind} {n_params / 1e6:.1f}M params, {args.dtype}, std {args.std:.4g}, "
          f"built in {phases.seconds['build']:.1f} s", flush=True)

    tok = ByteTokenizer()
    prompt = torch.tensor([tok.encode(SENTENCE * args.prompt_repeats)], device=device)
    P = prompt.shape[1]
    kernels = kernel_sources(model)
    common = dict(new_tokens=N, warmup_tokens=args.warmup_tokens, repeats=args.repeats)
    progress = progress or (lambda **parts: None)
    progress(config={"kind": args.kind, **cfg, "dtype": args.dtype, "params": n_params, "new_tokens": N,
                     "num_draft_tokens": k}, environment=environment(device))

    # (1) transformers' own path, (2) its PyTorch reference functions, before the in-place conversion.
    runs = {}

    def measured():  # the rows so far, on disk (a run cut by a time limit keeps them)
        progress(tokens_per_s={name: r["tokens_per_s"] for name, r in runs.items()}, phases_s=dict(phases.seconds))

    runs["hf"] = timed_generate(model, prompt, clock, phases, "hf", **common)
    print(f"hf:          {runs['hf']['tokens_per_s']:8.1f} tok/s", flush=True)
    measured()
    hf_torch = {"kernels": None, "patched": None, "same_as_hf": None}
    if args.hf_torch:
        runs["hf-torch"], hf_torch = timed_generate_hf_torch(model, prompt, clock, phases, kernels, **common)
        same = f" (the same kernels as hf, {same_kernels_why(kernels)})" if hf_torch["same_as_hf"] else ""
        print(f"hf-torch:    {runs['hf-torch']['tokens_per_s']:8.1f} tok/s{same}", flush=True)
        measured()
    skipped = {}
    for name, extra in (("hf_lookup", {"prompt_lookup_num_tokens": k}), ("hf_static", {"cache_implementation": "static"})):
        if name in args.skip:
            skipped[name] = "--skip"
            continue
        try:
            runs[name] = timed_generate(model, prompt, clock, phases, name, make_extra=lambda extra=extra: dict(extra),
                                        **common)
            print(f"{name + ':':<12} {runs[name]['tokens_per_s']:8.1f} tok/s", flush=True)
            measured()
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
    # (3)-(6) through transformers' own decoding loop (the converted cache and graphed forwards);
    # (7), (8) through ssm-spec's decode loop, after them.
    with phases("convert"):
        apply_recoverssm(model, state_dtype=state_dtype, decode_loop=False)
    key = cache_kwarg(model)
    loop_only = getattr(args, "loop_only", False)  # (3)-(6) and their single forwards skipped
    acceptance = graphs = ours_forwards = None
    if not loop_only:
        runs["ours"] = timed_generate(model, prompt, clock, phases, "ours", **common)
        print(f"ours:        {runs['ours']['tokens_per_s']:8.1f} tok/s", flush=True)
        measured()

        def lookup_cache():
            cache = RecoverSSMCache(model, max_pending=k + 1, state_dtype=state_dtype)
            return {"prompt_lookup_num_tokens": k, key: cache}

        runs["ours+lookup"] = timed_generate(model, prompt, clock, phases, "lookup", make_extra=lookup_cache,
                                             **common)
        print(f"ours+lookup: {runs['ours+lookup']['tokens_per_s']:8.1f} tok/s", flush=True)
        measured()
        acceptance = acceptance_summary(runs["ours+lookup"]["extra"][key].stats)

    if args.graphs and not loop_only:
        apply_recoverssm(model, cuda_graphs=True)
        runs["graphs"] = timed_generate(model, prompt, clock, phases, "graphs", **common)
        print(f"graphs:      {runs['graphs']['tokens_per_s']:8.1f} tok/s", flush=True)
        measured()
        runs["graphs+lookup"] = timed_generate(model, prompt, clock, phases, "graphs+lookup",
                                               make_extra=lambda: {"prompt_lookup_num_tokens": k}, **common)
        print(f"graphs+lookup: {runs['graphs+lookup']['tokens_per_s']:6.1f} tok/s", flush=True)
        measured()
        gcache = kept_cache(model)
        gf = gcache.graphed
        graphs = {"captured": len(gf.graphs), "replays": gf.replays, "eager_forwards": gf.eager_forwards,
                  "failed": gf.failed, "kv_capacity": gcache.kv_capacity,
                  "acceptance": acceptance_summary(gcache.stats)}
        apply_recoverssm(model, cuda_graphs=False)

    loop = None
    if args.loop:
        loop = loop_runs(model, tok, SENTENCE, args, timed_generate, common, phases, clock, runs,
                         progress=lambda section: (measured(), progress(loop=section)))

    if not loop_only:
        with phases("ours forwards"):
            ours_forwards = time_forwards(
                model, prompt, clock, [1, k + 1], args.forward_reps, args.forward_warmup, rollback=True, key=key,
                make_cache=lambda: RecoverSSMCache(model, max_pending=k + 1, state_dtype=state_dtype))

    # Agreement of the token sequences.
    pairs = [("hf", "hf-torch")] if "hf-torch" in runs else []
    pairs += [("hf", name) for name in ("hf_lookup", "hf_static") if name in runs]
    if not loop_only:
        pairs += [("hf", "ours"), ("hf", "ours+lookup"), ("ours", "ours+lookup")]
    if graphs is not None:
        pairs += [("hf", "graphs"), ("hf", "graphs+lookup"), ("ours", "graphs"), ("ours+lookup", "graphs+lookup")]
    if "loop" in runs:
        pairs += [("hf", "loop"), ("hf", "loop+lookup"), ("loop", "loop+lookup")]
        pairs += [] if loop_only else [("ours", "loop")]
    with phases("agreement"):
        agreement = token_agreement(runs, pairs, plain_logits, prompt, model)
    top2 = torch.topk(plain_logits[P - 1:P - 1 + N], 2).values
    gen_gaps = (top2[:, 0] - top2[:, 1]).tolist()

    for r in runs.values():
        r.pop("extra", None)
    tps = {name: r["tokens_per_s"] for name, r in runs.items()}
    res = {
        "environment": environment(device),
        "config": {"kind": args.kind, **cfg, **init, "dtype": args.dtype, "state_dtype": args.state_dtype,
                   "params": n_params, "seed": args.seed, "prompt_len": P, "prompt_repeats": args.prompt_repeats,
                   "new_tokens": N, "num_draft_tokens": k, "repeats": args.repeats,
                   "warmup_tokens": args.warmup_tokens, "forward_reps": args.forward_reps, "quick": args.quick,
                   "batch": 1, "loop_batches": list(args.batch) if args.loop else [], "greedy": True,
                   "hf_torch": args.hf_torch, "graphs": args.graphs, "loop_only": loop_only},
        "hf_kernels": kernels,
        "hf_torch_kernels": hf_torch["kernels"],
        "hf_torch_patched": hf_torch["patched"],
        "hf_torch_same_as_hf": hf_torch["same_as_hf"],
        "runs": runs,
        "skipped": skipped,
        "tokens_per_s": tps,
        "speedup_lookup_over_hf": ratio(tps, "ours+lookup", "hf"),
        "speedup_ours_over_hf": ratio(tps, "ours", "hf"),
        "speedup_lookup_over_ours": ratio(tps, "ours+lookup", "ours"),
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
        "loop": loop,
        "speedup_loop_over_hf_static": ratio(tps, "loop", "hf_static"),
        "speedup_loop_over_graphs": ratio(tps, "loop", "graphs"),
        "speedup_loop_lookup_over_graphs_lookup": ratio(tps, "loop+lookup", "graphs+lookup"),
        "speedup_loop_lookup_over_hf_lookup": ratio(tps, "loop+lookup", "hf_lookup"),
        "agreement": agreement,
        "plain_min_logit_gap": min(gen_gaps) + 0.0 if gen_gaps else None,
        "plain_logit_gaps": gen_gaps,
        "forwards": {"ours": ours_forwards, "hf": hf_forwards},
        "phases_s": phases.seconds,
        "total_s": time.perf_counter() - t_start,
    }
    if ours_forwards is not None:
        fw1, fwW = ours_forwards["1"], ours_forwards[str(k + 1)]
        res["forwards"].update(ours_verify_over_decode=fwW["forward_ms"] / fw1["forward_ms"],
                               ours_verify_over_decode_with_crop=fwW["forward_plus_crop_ms"] / fw1["forward_plus_crop_ms"])
    if str(k + 1) in hf_forwards:
        res["forwards"]["hf_verify_over_decode"] = (hf_forwards[str(k + 1)]["forward_ms"]
                                                    / hf_forwards["1"]["forward_ms"])
    return res
