"""The one inner update that GDN verify, commit and the native snapshot share.

Bit identity between commit and the native per-token state (DESIGN.md section 2) holds
because all three kernels build the state with *these* functions, on tiles of the same shape
and ``num_warps`` (the order of the K reduction that produces ``u`` depends on them). Change
the tile configuration only here, for all three at once.

On CUDA the two state operations are written as PTX (``mul.rn.f32`` and ``fma.rn.f32``), which
neither LLVM nor ptxas may contract or reorder. Written as ``b_h * b_d`` and ``tl.fma``, the
compiled verify kernel (where ``P`` also feeds the reduction) rounded differently from the
commit kernel in about 5 % of the elements for some tile shapes on the H200 (K=16 or 32),
while K=64 happened to agree: the compiler, not the source, decided. ``USE_PTX`` is off
under ``TRITON_INTERPRET=1`` (the interpreter runs no PTX), where plain operations are exact.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: Epsilon of the q/k L2 normalisation (DESIGN.md section 2).
L2NORM_EPS: tl.constexpr = tl.constexpr(1e-6)


@triton.jit
def l2_normalize(x):
    """``x / sqrt(sum(x * x) + 1e-6)`` in fp32 with IEEE-rounded sqrt and division."""
    return tl.div_rn(x, tl.sqrt_rn(tl.sum(x * x, axis=0) + L2NORM_EPS))


@triton.jit
def gdn_decay(b_h, b_d, USE_PTX: tl.constexpr):
    """``P = S * d`` for a ``[BK, BV]`` fp32 state tile and a scalar decay, rounded once."""
    if USE_PTX:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [b_h, tl.broadcast_to(b_d, b_h.shape)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        return b_h * b_d


@triton.jit
def gdn_correction(b_p, b_k, b_v, b_beta):
    """``u = beta * (v - P^T k̂)``: ``[BV]`` from ``P [BK, BV]``, ``k̂ [BK]``, ``v [BV]``."""
    return b_beta * (b_v - tl.sum(b_p * b_k[:, None], axis=0))


@triton.jit
def gdn_apply(b_p, b_k, b_u, USE_PTX: tl.constexpr):
    """``S = fma(k̂, u, P)`` elementwise: ``S[i, j] = k̂[i] * u[j] + P[i, j]``, one rounding."""
    if USE_PTX:
        return tl.inline_asm_elementwise(
            "fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r",
            [tl.broadcast_to(b_k[:, None], b_p.shape), tl.broadcast_to(b_u[None, :], b_p.shape), b_p],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.fma(b_k[:, None], b_u[None, :], b_p)


def use_ptx() -> bool:
    """Whether the kernels may use PTX inline assembly (not under the Triton interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True") and torch.version.hip is None


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def gdn_tile_config(K: int, V: int) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)`` for a ``[K, V]`` state, shared by verify, snapshot and commit.

    A program holds the whole key dim (``BK = next_pow2(K)``, needed for the normalisation and
    the reduction) and a ``BV``-wide slice of the value dim, about 4096 fp32 in registers.
    """
    bk = next_power_of_2(K)
    bv = min(next_power_of_2(V), max(8, 4096 // bk))
    return bk, bv, 4
