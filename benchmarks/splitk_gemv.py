"""A split-K GEMV in Triton: the candidate ``bench_gemv.py`` times against cuBLAS for the
projections of a decode step (a few rows, a weight read once).

``y [M, N] = x [M, K] @ w [N, K]^T`` for ``M <= 16`` rows. The grid is ``(ceil(N / block_n),
splits)``: each program reads one ``block_n x K / splits`` tile of the weight, once, and
multiplies it with every row (``tl.dot`` on the rows padded to 16, fp32 accumulation); with
``splits > 1`` the ``[splits, M, N]`` fp32 partial sums are added by a second kernel in a fixed
order (the same bits every run: no atomics). Splitting ``K`` gives a narrow projection (2,560
outputs over 4,096 or 9,216 inputs at the 3.6 B width, where cuBLAS reaches 0.48-0.68 of the copy
bandwidth on an H200, 0.59-0.80 on an H100) enough programs to keep every SM's loads in flight.

Not used by the library's forward: on an H100 it takes 1-7 % less time than cuBLAS on the narrow
projections and at most 3 % less on the wide ones, where inductor's one-row GEMV takes 16-23 %
less on the narrow ones (``docs/perf-notes.md``; ``ssm_spec.hf.narrow_gemv`` takes that).
Measured alone (``bench_gemv.py``, backend
``triton_splitk``, the fastest of :data:`CONFIGS` per shape) and inside the compiled forward
(``scripts/forward_cost.py``'s variant ``fused, compiled, split-K narrow``: :func:`use_splitk`
runs a model's narrow projections through the custom op :func:`splitk_linear`).
"""

from __future__ import annotations

import functools
import itertools
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from ssm_spec.capture import collection_paused

__all__ = ["splitk_gemv", "splitk_gemv_ref", "split_plan", "CONFIGS", "MAX_ROWS", "graph_us", "best_config", "splitk_linear",
           "use_splitk", "SplitKLinear"]

#: The most rows one call takes (``tl.dot`` tiles of 16 rows).
MAX_ROWS = 16
#: The (block_n, block_k, splits, num_warps) a sweep tries (kernel names hold "gemv", so the
#: forward profiles count them with the GEMMs: ``forward_timing.GEMM_KERNEL``).
CONFIGS = tuple(itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8, 16), (4,)))


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count of a shape
def _splitk_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DIRECT: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * K_SPLIT
    for k0 in range(0, K_SPLIT, BLOCK_K):
        inner = k0 + tl.arange(0, BLOCK_K)
        offs_k = k_lo + inner
        k_ok = (offs_k < K) & (inner < K_SPLIT)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if DIRECT:  # one split: the sums are the outputs
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + (pid_s * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=ok)


@triton.jit
def _splitk_gemv_sum_kernel(part_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # in split order: the same sum every run
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_plan(K: int, splits: int, block_k: int) -> tuple[int, int]:
    """``(k_split, splits)`` that :func:`splitk_gemv` launches for ``splits`` asked: each program
    takes ``k_split`` inputs (a multiple of ``block_k``), and the programs along ``K`` number
    ``ceil(K / k_split)``, which can be fewer than asked (none without inputs: ``K=9216``,
    ``block_k=128``, 16 asked gives 15 of 640)."""
    k_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    return k_split, triton.cdiv(K, k_split)


def splitk_gemv(x: torch.Tensor, w: torch.Tensor, *, block_n: int = 64, block_k: int = 128, splits: int = 4,
                num_warps: int = 4) -> torch.Tensor:
    """``x @ w.T`` by the split-K kernels.

    Args:
        x: ``[M, K]``, ``1 <= M <= 16``, float32 / bfloat16 / float16, unit stride along ``K``.
        w: ``[N, K]`` of ``x``'s dtype and device, unit stride along ``K`` (an ``nn.Linear`` weight).
        block_n / block_k: the weight tile of a program (powers of two, at least 16).
        splits: programs asked along ``K`` per ``block_n`` outputs; the launch may have fewer
            (:func:`split_plan`).
        num_warps: warps a program.

    Returns:
        ``[M, N]`` in ``x``'s dtype (fp32 accumulation; float32 inputs multiply in IEEE fp32, not TF32).

    Raises:
        ValueError: shapes, dtypes, devices or strides other than the above, or a tile that is
            not a power of two of at least 16.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"splitk_gemv: x {tuple(x.shape)} and w {tuple(w.shape)}; expected [M, K] and [N, K]")
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"splitk_gemv: x has {M} rows; expected 1 to {MAX_ROWS}")
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.device != w.device:
        raise ValueError(f"splitk_gemv: x is {x.dtype} on {x.device}, w {w.dtype} on {w.device}; expected one "
                         "float dtype on one device")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"splitk_gemv: strides x {x.stride()}, w {w.stride()}; expected unit stride along K")
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"splitk_gemv: {name}={value}; expected a power of two >= 16")
    if splits < 1:
        raise ValueError(f"splitk_gemv: splits={splits}; expected >= 1")
    k_split, splits = split_plan(K, splits, block_k)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    direct = splits == 1
    out = y if direct else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), splits)
    _splitk_gemv_kernel[grid](x, w, out, M, N, K, k_split, x.stride(0), w.stride(0), BLOCK_M=16, BLOCK_N=block_n,
                         BLOCK_K=block_k, DIRECT=direct, IEEE=x.dtype == torch.float32, num_warps=num_warps)
    if not direct:
        block = 1024
        _splitk_gemv_sum_kernel[(triton.cdiv(M * N, block),)](out, y, M * N, SPLITS=splits, BLOCK=block, num_warps=4)
    return y


def splitk_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product in float64 (what :func:`splitk_gemv` is compared with)."""
    return x.double() @ w.double().T


# ----------------------------------------------------------------------------- timing and tuning
def graph_us(fn, xs, ws, calls: int, reps: int) -> float:
    """Median microseconds per call of ``fn(x, w)`` over a CUDA graph of ``calls`` calls cycling
    over the inputs ``xs`` and the weight copies ``ws`` (enough copies that none is read from L2
    twice: a weight read once, as in a decode step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collection_paused(), torch.cuda.graph(graph):  # a graph collected inside would end the capture
        for i in range(calls):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return statistics.median(times)


def best_config(xs, ws, calls: int = 64, reps: int = 5):
    """``(us, config)`` of the fastest :data:`CONFIGS` entry for these inputs, timed by
    :func:`graph_us` (a tile Triton cannot build on this device is skipped); ``None`` if none builds.
    The config's ``splits`` is the count launched (:func:`split_plan`), and entries that launch
    the same grid are timed once."""
    best, seen = None, set()
    K = xs[0].shape[1]
    for block_n, block_k, asked, warps in CONFIGS:
        splits = split_plan(K, asked, block_k)[1]
        if (block_n, block_k, splits, warps) in seen:
            continue
        seen.add((block_n, block_k, splits, warps))
        fn = functools.partial(splitk_gemv, block_n=block_n, block_k=block_k, splits=splits, num_warps=warps)
        try:
            us = graph_us(fn, xs, ws, calls, reps)
        except (RuntimeError, triton.runtime.errors.OutOfResources):  # this tile does not fit the device
            continue
        if best is None or us < best[0]:
            best = (us, dict(block_n=block_n, block_k=block_k, splits=splits, num_warps=warps))
    return best


# ----------------------------------------------------------------------------- inside a model
#: ``(rows, out_features, in_features, dtype) -> config`` chosen by :func:`use_splitk`.
TUNED: dict = {}


@torch.library.custom_op("ssm_spec_bench::splitk_linear", mutates_args=())
def splitk_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [..., K]``: by :func:`splitk_gemv` with the tuned config
    where the rows (``x``'s leading dims flattened) number at most :data:`MAX_ROWS` on CUDA and a
    config was tuned for the shape, else cuBLAS."""
    rows = x.numel() // x.shape[-1]
    config = TUNED.get((rows, weight.shape[0], weight.shape[1], x.dtype)) if x.is_cuda else None
    if config is None:
        return F.linear(x, weight)
    y = splitk_gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight, **config)
    return y.view(*x.shape[:-1], weight.shape[0])


@splitk_linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class SplitKLinear(nn.Linear):
    """An ``nn.Linear`` (its class swapped in place: same parameters, names and state dict) whose
    product runs through :func:`splitk_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = splitk_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


#: The projections back to the residual stream (``hidden_size`` outputs, wider inputs at the 3.6 B
#: width): GDN's ``out_proj``, attention's ``o_proj``, the MLPs' ``down_proj``.
NARROW = ("out_proj", "o_proj", "down_proj")


def use_splitk(model, rows=(1, 4, 6), enable: bool = True) -> list[str]:
    """Run ``model``'s narrow projections (:data:`NARROW` ``nn.Linear`` modules with
    ``hidden_size`` outputs) through
    :func:`splitk_linear`, with the fastest config of each shape at each of ``rows`` tuned now on
    copies of the weights; ``enable=False`` puts the class each had back. Returns the
    modules' names."""
    hidden = model.config.get_text_config().hidden_size
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == hidden and name.rsplit(".", 1)[-1] in NARROW:
            if not enable:  # the class it had (ssm_spec.hf.narrow_gemv's NarrowLinear on a converted model)
                if type(module) is SplitKLinear:
                    module.__class__ = module.__dict__.pop("_class_before_splitk", nn.Linear)
                    names.append(name)
                continue
            if type(module) is not SplitKLinear:
                object.__setattr__(module, "_class_before_splitk", module.__class__)
            module.__class__ = SplitKLinear
            names.append(name)
            w = module.weight
            for m in rows if w.is_cuda else ():  # off CUDA the op is cuBLAS's (CPU BLAS) product
                key = (m, w.shape[0], w.shape[1], w.dtype)
                if key in TUNED:
                    continue
                copies = max(2, -(-int(256e6) // (w.numel() * w.element_size())))
                ws = [torch.randn_like(w) * 0.02 for _ in range(copies)]
                xs = [torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for _ in range(2)]
                found = best_config(xs, ws)
                if found is not None:
                    TUNED[key] = found[1]
                del ws
    return names
