"""A split-K GEMV in Triton: the candidate ``bench_gemv.py`` times against cuBLAS for the
projections of a decode step (a few rows, a weight read once).

``y [M, N] = x [M, K] @ w [N, K]^T`` for ``M <= 16`` rows. The grid is ``(ceil(N / block_n),
splits)``: each program reads one ``block_n x K / splits`` tile of the weight, once, and
multiplies it with every row (``tl.dot`` on the rows padded to 16, fp32 accumulation); with
``splits > 1`` the ``[splits, M, N]`` fp32 partial sums are added by a second kernel in a fixed
order (the same bits every run: no atomics). Splitting ``K`` gives a narrow projection (2,560
outputs over 4,096 or 9,216 inputs at the 3.6 B width, where cuBLAS reaches 0.48-0.68 of the copy
bandwidth) enough programs to keep every SM's loads in flight.

Not used by the library's forward: it is measured first (``bench_gemv.py``, backend
``triton_splitk``, the fastest of :data:`CONFIGS` per shape).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

__all__ = ["splitk_gemv", "splitk_gemv_ref", "CONFIGS", "MAX_ROWS"]

#: The most rows one call takes (``tl.dot`` tiles of 16 rows).
MAX_ROWS = 16
#: The (block_n, block_k, splits, num_warps) a sweep tries.
CONFIGS = tuple(itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16), (4,)))


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
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
def _sum_splits_kernel(part_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # in split order: the same sum every run
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def splitk_gemv(x: torch.Tensor, w: torch.Tensor, *, block_n: int = 64, block_k: int = 128, splits: int = 4,
                num_warps: int = 4) -> torch.Tensor:
    """``x @ w.T`` by the split-K kernels.

    Args:
        x: ``[M, K]``, ``1 <= M <= 16``, float32 / bfloat16 / float16, unit stride along ``K``.
        w: ``[N, K]`` of ``x``'s dtype and device, unit stride along ``K`` (an ``nn.Linear`` weight).
        block_n / block_k: the weight tile of a program (powers of two, at least 16).
        splits: programs along ``K`` per ``block_n`` outputs.
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
    k_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_split)  # no program without inputs
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    direct = splits == 1
    out = y if direct else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), splits)
    _splitk_kernel[grid](x, w, out, M, N, K, k_split, x.stride(0), w.stride(0), BLOCK_M=16, BLOCK_N=block_n,
                         BLOCK_K=block_k, DIRECT=direct, IEEE=x.dtype == torch.float32, num_warps=num_warps)
    if not direct:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](out, y, M * N, SPLITS=splits, BLOCK=block, num_warps=4)
    return y


def splitk_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product in float64 (what :func:`splitk_gemv` is compared with)."""
    return x.double() @ w.double().T
