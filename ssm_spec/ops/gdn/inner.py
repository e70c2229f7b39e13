"""The one inner update that GDN verify, commit and the native snapshot share.

Bit identity between commit and the native per-token state (DESIGN.md section 2) holds
because all three kernels build the state with *these* functions, on tiles of the same shape
and ``num_warps`` (the order of the K reduction that produces ``u`` depends on them). Change
the tile configuration only here, for all three at once.

What the H200 taught us (scripts/diag_bitwise.py): with ``k̂`` normalised as a replicated
``[BK]`` vector, the ``k̂`` a program recorded and the one its own state update used differed
in the last bit for some shapes (K=16, 32), so commit (which follows the record exactly) and
the snapshot disagreed in about 5 % of the elements of one token in four. ``k̂`` is now
normalised as a state-shaped ``[BK, BV]`` tile (:func:`l2_normalize_tile`) and recorded from
that tile. As further guards, the two state operations are PTX (``mul.rn.f32``,
``fma.rn.f32``), which neither LLVM nor ptxas may contract, and :func:`pin` makes the stored
``k̂`` and ``u`` the registers the update reads. ``USE_PTX`` is off under
``TRITON_INTERPRET=1`` (the interpreter runs no PTX), where plain operations are exact.
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
def l2_normalize_tile(x):
    """Column-wise ``x / sqrt(sum(x * x) + 1e-6)`` of a ``[BK, BV]`` tile whose columns all
    hold the same key vector. Normalising in the state tile's own layout gives every column,
    every value head and every V tile the same bits, and the recorded ``k̂`` is taken from
    this very tile. (Normalised as a replicated ``[BK]`` vector, the recorded ``k̂`` and the
    one the update used differed in the last bit on the H200 for some shapes.)"""
    return tl.div_rn(x, tl.sqrt_rn(tl.sum(x * x, axis=0) + L2NORM_EPS)[None, :])


@triton.jit
def gdn_correction(b_p, b_k, b_v, b_beta):
    """``u = beta * (v - P^T k̂)``: ``[BV]`` from ``P [BK, BV]``, ``k̂ [BK, BV]`` (a key
    broadcast along V), ``v [BV]``."""
    return b_beta * (b_v - tl.sum(b_p * b_k, axis=0))


@triton.jit
def gdn_apply(b_p, b_k, b_u, USE_PTX: tl.constexpr):
    """``S = fma(k̂, u, P)`` elementwise: ``S[i, j] = k̂[i, j] * u[j] + P[i, j]`` (``k̂`` a key
    broadcast along V), one rounding."""
    if USE_PTX:
        return tl.inline_asm_elementwise(
            "fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r",
            [b_k, tl.broadcast_to(b_u[None, :], b_p.shape), b_p],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.fma(b_k, b_u[None, :], b_p)


def use_ptx() -> bool:
    """Whether the kernels may use PTX inline assembly (not under the Triton interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True") and torch.version.hip is None


@triton.jit
def pin(x, USE_PTX: tl.constexpr):
    """An opaque identity: every later use of ``x`` (the record store and the state update)
    reads these very registers. Without it Triton may rematerialize the producer chain of a
    value in another layout for one of its uses, and a rematerialized reduction sums in
    another order."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=False, pack=1)
    else:
        return x


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
