"""What ``bench_hf_generate.py`` measures of ssm-spec's decode loop (``ssm_spec.hf.loop``) on the
converted model: ``loop`` (plain greedy) and ``loop+lookup`` (``prompt_lookup_num_tokens=k``) at
each ``--batch`` size, captured as CUDA graphs with ``--graphs`` on CUDA (eager otherwise), and
the GPU time of one decode and one verify forward inside the loop against the weight-read floor,
all in the same run.

The ratios it derives (docs/design.md section 7.7, benchmarks/README.md):

- ``loop_ms_per_token_over_gpu_forward``: wall milliseconds per generated token of ``loop`` at
  batch 1 (the prompt's prefill included) over ``gpu_ms_per_decode_forward`` (the kernels of one
  decode forward, summed): 1.0 means the host adds nothing to a captured decode step;
- ``loop_lookup_over_loop`` (per batch size) beside the mean accepted length (tokens per round):
  the share of the accepted length that speculation turns into speed;
- ``gpu_forward_over_floor``: ``gpu_ms_per_decode_forward`` over ``weight_read_floor_ms`` (every
  parameter read once at the device-to-device copy bandwidth measured here).
"""

from __future__ import annotations

import torch
from forward_timing import copy_bandwidth, loop_forward_gpu_ms, weight_read_floor_ms

__all__ = ["batch_prompt", "loop_runs"]


def batch_prompt(tok, sentence: str, repeats: int, batch: int, device) -> torch.Tensor:
    """``[batch, L]`` prompts of one length: row ``i`` repeats ``sentence`` rotated by ``7 i``
    characters, so rows differ but each stays as repetitive as the batch-1 prompt."""
    rows = []
    for i in range(batch):
        s = (7 * i) % len(sentence)
        rows.append(tok.encode((sentence[s:] + sentence[:s]) * repeats))
    return torch.tensor(rows, device=device)


def loop_runs(model, tok, sentence: str, args, timed_generate, common: dict, phases, clock, runs: dict,
              progress=None) -> dict:
    """Time the loop's runs on the converted ``model`` and add them to ``runs`` (batch 1 under
    ``loop`` / ``loop+lookup``, other sizes under ``loop@B`` / ``loop+lookup@B``). Returns the
    ``"loop"`` section of the results: per batch size the tokens/s, the ratio and the acceptance;
    on CUDA the forward GPU times, the floor and the ratios above. ``progress(section)``, where
    given, is called with the section as it grows (after each batch size and the forwards)."""
    progress = progress or (lambda section: None)
    from ssm_spec.hf import acceptance_stats, apply_recoverssm, recoverssm_config
    from ssm_spec.hf.loop import bucket_for

    device = model.get_input_embeddings().weight.device
    k = args.num_draft_tokens
    graphs = bool(args.graphs and device.type == "cuda")
    setting = {"on": True, "off": False}.get(getattr(args, "compile", "auto"), "auto")
    apply_recoverssm(model, decode_loop=True, cuda_graphs=graphs, compile=setting)
    compiled = recoverssm_config(model).compiles_on(device)
    section = {"cuda_graphs": graphs, "compile": compiled, "num_draft_tokens": k, "by_batch": {}}
    capacity: dict[int, int] = {}  # window width -> token columns of the batch-1 loop that ran it
    for B in args.batch:
        ids = batch_prompt(tok, sentence, args.prompt_repeats, B, device)
        suffix = "" if B == 1 else f"@{B}"
        plain = timed_generate(model, ids, clock, phases, f"loop{suffix}", **common)
        if B == 1:  # the forwards below are timed on the buffers of these loops (their compiled graphs reused)
            capacity[1] = model._recoverssm.loop.rows.capacity
        lookup = timed_generate(model, ids, clock, phases, f"loop+lookup{suffix}",
                                make_extra=lambda: {"prompt_lookup_num_tokens": k}, **common)
        if B == 1:
            capacity[k + 1] = model._recoverssm.loop.rows.capacity
        stats = acceptance_stats(model)
        runs[f"loop{suffix}"], runs[f"loop+lookup{suffix}"] = plain, lookup
        loop = model._recoverssm.loop
        mal = stats.mean_accepted_length if stats is not None else None
        entry = {"batch": B, "bucket": bucket_for(B), "loop_tokens_per_s": plain["tokens_per_s"],
                 "loop_lookup_tokens_per_s": lookup["tokens_per_s"],
                 "loop_lookup_over_loop": lookup["tokens_per_s"] / plain["tokens_per_s"],
                 "mean_accepted_length": mal, "acceptance_rate": stats.acceptance_rate if stats else None,
                 "rounds": stats.rounds if stats else None,
                 "share_of_accepted_length": (lookup["tokens_per_s"] / plain["tokens_per_s"] / mal) if mal else None,
                 "graph_replays": loop.replays, "eager_rounds": loop.eager_rounds, "capture_failed": loop.failed}
        section["by_batch"][str(B)] = entry
        print(f"loop batch {B}: {plain['tokens_per_s']:8.1f} tok/s, +lookup {lookup['tokens_per_s']:8.1f} "
              f"({entry['loop_lookup_over_loop']:.2f}x; {mal or 0:.2f} tokens/round)", flush=True)
        progress(section)
    if device.type == "cuda":
        with phases("loop forwards"):
            bandwidth = copy_bandwidth(device)
            floor_ms, nbytes = weight_read_floor_ms(model, bandwidth)
            # at batch 1, over the columns of the batch-1 loops above (a width no loop ran, W = 4
            # where k is not 3, over the lookup loop's): the forwards those loops replayed, and
            # their compiled graphs, not one more compile per width
            widths = sorted({4, k + 1})  # W = 4 and k + 1: the verify widths of k = 3 and of this run
            columns = {W: capacity.get(W, capacity.get(k + 1)) for W in [1, *widths]}
            decode = loop_forward_gpu_ms(model, 1, compile=compiled, capacity=columns[1])
            by_width = {W: loop_forward_gpu_ms(model, W, compile=compiled, capacity=columns[W]) for W in widths}
            verify = by_width[k + 1]
        section.update(copy_bandwidth_GBps=bandwidth / 1e9, param_bytes=nbytes, weight_read_floor_ms=floor_ms,
                       forward_columns={str(W): c for W, c in columns.items()},
                       gpu_ms_per_decode_forward=decode["ms"], gpu_ms_per_verify_forward=verify["ms"],
                       kernels_per_decode_forward=decode["kernels"], kernels_per_verify_forward=verify["kernels"],
                       gemm_ms_per_decode_forward=decode["gemm_ms"], gemm_kernels_per_decode_forward=decode["gemm_kernels"],
                       first_decode_forward_s=decode["first_call_s"], decode_forward_kernels=decode["breakdown"],
                       gpu_forward_over_floor=decode["ms"] / floor_ms,
                       verify_over_decode_gpu=verify["ms"] / decode["ms"],
                       gpu_ms_per_verify_forward_by_width={str(W): r["ms"] for W, r in by_width.items()},
                       verify_over_decode_gpu_by_width={str(W): r["ms"] / decode["ms"] for W, r in by_width.items()})
        if "1" in section["by_batch"]:
            ms_per_token = 1e3 / section["by_batch"]["1"]["loop_tokens_per_s"]
            section.update(loop_ms_per_token=ms_per_token,
                           loop_ms_per_token_over_gpu_forward=ms_per_token / decode["ms"])
        progress(section)
    apply_recoverssm(model, decode_loop=False, cuda_graphs=False, compile="auto")  # frees the loop's buffers and graphs
    return section
