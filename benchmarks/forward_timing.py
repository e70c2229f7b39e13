"""GPU time of one forward of a converted model inside the decode loop, and the floor it runs
against: what ``bench_hf_generate.py`` reports as ``gpu_ms_per_decode_forward`` /
``gpu_ms_per_verify_forward`` and ``weight_read_floor_ms``.

A forward's GPU time is the sum of its kernels' durations (``torch.profiler``, CUDA activity),
so host gaps between kernels do not count: it is what a captured forward costs when nothing else
does. The floor is the parameter bytes one forward reads over the device-to-device copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import re
import statistics
import time

import torch

__all__ = ["copy_bandwidth", "weight_read_floor_ms", "loop_forward_gpu_ms", "kernel_breakdown", "GEMM_KERNEL",
           "KERNEL_KINDS"]

#: cuBLAS / CUTLASS GEMM and GEMV kernel names (Hopper's ``nvjet`` included).
GEMM_KERNEL = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas", re.IGNORECASE)
#: What a kernel of a forward is, by its name (the first pattern that matches; else "other"):
#: GEMMs, ssm_spec's own op kernels, attention, inductor's fused kernels, copies and fills.
KERNEL_KINDS = (("gemm", GEMM_KERNEL),
                ("ssm_spec op", re.compile(r"^(gdn_|short_conv_)\w*kernel")),
                ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.IGNORECASE)),
                ("inductor fused", re.compile(r"^triton_")),
                ("copy / fill", re.compile(r"memcpy|memset|copy|fill", re.IGNORECASE)))


def kernel_breakdown(kernels, top: int = 15) -> dict:
    """Where one forward's kernel time goes, from ``kernels``: ``(name, microseconds)`` per
    launch. Returns ``{"by_kind": {kind: {"kernels": n, "ms": t}}, "top": [[name, launches,
    ms], ...]}`` (kinds of :data:`KERNEL_KINDS`; ``top``: the ``top`` names by total time,
    names cut to 120 characters)."""
    by_kind: dict[str, dict] = {}
    by_name: dict[str, list] = {}
    for name, us in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        entry = by_kind.setdefault(kind, {"kernels": 0, "ms": 0.0})
        entry["kernels"] += 1
        entry["ms"] += us / 1e3
        row = by_name.setdefault(name[:120], [name[:120], 0, 0.0])
        row[1] += 1
        row[2] += us / 1e3
    ranked = sorted(by_name.values(), key=lambda r: -r[2])[:top]
    return {"by_kind": by_kind, "top": ranked}


def copy_bandwidth(device, nbytes: int = 1 << 31, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (median of
    ``reps`` copies of ``nbytes`` after a warm-up)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del src, dst
    return nbytes / statistics.median(times)


def weight_read_floor_ms(model, bandwidth: float) -> tuple[float, int]:
    """``(floor in ms, parameter bytes)``: every parameter read once per forward, at
    ``bandwidth`` bytes/s (an embedding table is read one row a token: not counted)."""
    emb = model.get_input_embeddings().weight
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    return 1e3 * nbytes / bandwidth, nbytes


def loop_forward_gpu_ms(model, width: int, reps: int = 5, batch: int = 1, prompt_len: int = 64,
                        compile: bool = False, capacity: int | None = None) -> dict:
    """Kernel time of one target verify forward of ``width`` tokens per row (``width=1``: a
    decode step) through the decode loop's forward (:class:`ssm_spec.hf.loop.forward.LoopModel`),
    after a prefill of ``prompt_len`` tokens: ``{"ms": median over reps, "kernels": kernels per
    forward, "gemm_ms" / "gemm_kernels": the cuBLAS GEMM kernels among them, "first_call_s": the
    first two forwards' wall time (compiling with ``compile``), "breakdown": the last timed
    forward's :func:`kernel_breakdown`}``. Each forward verifies from the
    same state (nothing is committed); ``compile``: through ``torch.compile`` as the loop's
    ``compile=True`` runs it. ``capacity``: token columns of the buffers (default: the prompt, the
    window and 8); give a decode loop's own (``loop.rows.capacity``, with its ``batch`` bucket and
    ``width = k + 1``) and the forward attends over as many columns as that loop's does and reuses
    its compiled graph (dynamo's guards hold for another model of the same shapes)."""
    from ssm_spec.hf import recoverssm_config
    from ssm_spec.hf.loop.forward import LoopModel
    from ssm_spec.hf.loop.rows import Rows

    config = recoverssm_config(model)
    device = model.get_input_embeddings().weight.device
    capacity = capacity or prompt_len + width + 8
    if capacity < prompt_len + width:
        raise ValueError(f"capacity={capacity} holds fewer columns than prompt_len + width = {prompt_len + width}")
    target = LoopModel(model, batch, capacity, width, state_dtype=config.state_dtype, mode=config.mode,
                       compile=compile)
    rows = Rows(batch, capacity, device, pad_token_id=0)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    rows.load(prompt, torch.zeros(batch, dtype=torch.int64, device=device), max_new=width + 4, min_new=0,
              min_length=0)
    with torch.no_grad():
        target.prefill(rows, prompt_len)
        rows.produced.fill_(1)
        columns = rows.window_columns(width)
        tokens = rows.window_tokens(columns)
        active = ~rows.finished
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(2):  # compile, autotune
            target.verify(tokens, columns, rows, active)
        torch.cuda.synchronize(device)
        first = time.perf_counter() - t0
        ms, kernels, gemm_ms, gemm_kernels, breakdown = [], [], [], [], None
        for _ in range(reps):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                target.verify(tokens, columns, rows, active)
                torch.cuda.synchronize(device)
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gemms = [e for e in events if GEMM_KERNEL.search(e.name)]
            ms.append(sum(e.time_range.elapsed_us() for e in events) / 1e3)
            kernels.append(len(events))
            gemm_ms.append(sum(e.time_range.elapsed_us() for e in gemms) / 1e3)
            gemm_kernels.append(len(gemms))
            breakdown = kernel_breakdown([(e.name, e.time_range.elapsed_us()) for e in events])
    del target
    return {"ms": statistics.median(ms), "kernels": int(statistics.median(kernels)), "ms_all": ms,
            "gemm_ms": statistics.median(gemm_ms), "gemm_kernels": int(statistics.median(gemm_kernels)),
            "first_call_s": first, "breakdown": breakdown}
