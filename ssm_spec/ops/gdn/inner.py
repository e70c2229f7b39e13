"""The inner update GDN verify, commit, the folded verify and the native snapshot share: the
ordered arithmetic every GDN kernel builds its states and reductions from.

Bit identity between commit and the native per-token state (docs/design.md section 2.3) holds
because every kernel builds the state with *these* functions: commit replays the records
verify wrote with the same elementwise update the snapshot applies. The bits of every
reduction (the correction ``u``, the output, the q/k norms) are fixed by :func:`kdot`, which
states its summation order in code instead of leaving it to ``tl.sum`` (whose tree follows the
layout Triton picks for a tile): so the tile (``BV``, ``num_warps``) and the compiled mode
(verify, snapshot, fold) change speed, never bits, and each kernel takes its own fastest tile
per batch size (:mod:`~ssm_spec.ops.gdn.tiles`). Tested on the H200 across tiles
(``tests/ops/gdn/test_ops.py::test_bits_do_not_depend_on_the_tile_on_gpu``, ``scripts/tune_gdn.py``).

History (``docs/perf-notes.md``): with ``tl.sum`` the order depended on the layout, and even
two compiled modes of one kernel (verify, snapshot) disagreed in the last bit; the kernels
then had to share one tile and one binary, and a replicated ``[BK]`` key norm recorded another
``k̂`` than the update used. As further guards the two state operations are PTX
(``mul.rn.f32``, ``fma.rn.f32``), which neither LLVM nor ptxas may contract, and :func:`pin`
makes the stored ``u`` the registers the update reads. ``USE_PTX`` is off under
``TRITON_INTERPRET=1`` (the interpreter runs no PTX), where plain operations are exact.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# the tile tables live in tiles.py; importable from here too (scripts and tests use this path)
from .tiles import KERNELS, TILES, block_k, check_tile, gdn_tile_config, next_power_of_2  # noqa: F401

#: Epsilon of the q/k L2 normalisation (docs/design.md section 2.1).
L2NORM_EPS: tl.constexpr = tl.constexpr(1e-6)
#: Halving steps :func:`kdot`'s fold unrolls (a bound, not a cost: enough for any ``BK`` a tile can hold, 2**20).
LOG2_MAX_BK: tl.constexpr = tl.constexpr(20)


@triton.jit
def _mul_rn(a, b, USE_PTX: tl.constexpr):
    """``a * b`` rounded once and opaque to LLVM (``mul.rn.f32``), so it is never contracted
    into a later addition: which addend a contraction picks would follow the layout."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _fold_halves(x):
    """``x[:N/2] + x[N/2:]`` along the leading (key) axis of a ``[N]`` or ``[N, BV]`` tensor:
    one IEEE addition of two named values per output (commutative), wherever Triton places
    them (one thread's registers, two lanes or two warps)."""
    if len(x.shape) == 1:
        return tl.sum(tl.reshape(x, (2, x.shape[0] // 2)), axis=0)
    else:
        return tl.sum(tl.reshape(x, (2, x.shape[0] // 2, x.shape[1])), axis=0)


@triton.jit
def _top_halves(x):
    """``x[:N/2], x[N/2:]`` along the leading (key) axis of a ``[N]`` or ``[N, BV]`` tensor (a
    reshape and a split: the top bit of the row index sits in a thread's registers in
    Triton's blocked layouts, so this moves nothing)."""
    if len(x.shape) == 1:
        return tl.split(tl.permute(tl.reshape(x, (2, x.shape[0] // 2)), (1, 0)))
    else:
        return tl.split(tl.permute(tl.reshape(x, (2, x.shape[0] // 2, x.shape[1])), (1, 2, 0)))


@triton.jit
def kdot(x, k, USE_PTX: tl.constexpr):
    """``sum_i x[i] * k[i]`` over the key axis (axis 0) of ``x`` (``[BK]`` or ``[BK, BV]``,
    ``BK`` a power of two >= 2) in an order written here, not chosen by Triton's layouts:

    * the key axis is cut into ``G`` blocks by the top bits of the row index (``G = 8`` for
      ``BK >= 8``, else 2; block ``j`` holds rows ``[j*BK/G, (j+1)*BK/G)``) and they are
      chained, row by row:
      ``a = x_0*k_0`` (``mul.rn``, never contracted), then ``a = fma(x_j, k_j, a)`` for
      ``j = 1..G-1``;
    * the ``BK/G`` rows of ``a`` are then folded in halves, ``a[i] + a[i + N/2]``, until one row
      is left (a perfect binary tree over the low bits of the row index).

    Every step combines named values in a fixed way (IEEE addition is commutative), so neither
    the layout Triton picks for a tile (``BV``, ``num_warps``) nor LLVM can change a bit: the
    result is a function of the inputs and this code alone (tested across tiles on the H200).
    In Triton's blocked layouts the high row bits sit in a thread's registers, so the block
    split moves nothing and the chain is one FMA per element. Replaces ``tl.sum``, whose tree
    follows the layout.
    """
    if len(x.shape) == 1:
        kx = k
    else:
        kx = tl.broadcast_to(k[:, None], x.shape)
    return kdot_pairs(x, kx, USE_PTX)


@triton.jit
def kdot_pairs(x, kx, USE_PTX: tl.constexpr):
    """:func:`kdot` of two tensors of one shape, column by column: ``sum_i x[i, j] * kx[i, j]``
    (``[BK]`` or ``[BK, N]``), in :func:`kdot`'s order (so a column's bits equal ``kdot`` of
    that column)."""
    if x.shape[0] >= 8:
        x_a, x_b = _top_halves(x)
        k_a, k_b = _top_halves(kx)
        x0, x1 = _top_halves(x_a)
        x2, x3 = _top_halves(x_b)
        k0, k1 = _top_halves(k_a)
        k2, k3 = _top_halves(k_b)
        x00, x01 = _top_halves(x0)
        x10, x11 = _top_halves(x1)
        x20, x21 = _top_halves(x2)
        x30, x31 = _top_halves(x3)
        k00, k01 = _top_halves(k0)
        k10, k11 = _top_halves(k1)
        k20, k21 = _top_halves(k2)
        k30, k31 = _top_halves(k3)
        acc = _mul_rn(x00, k00, USE_PTX)
        acc = tl.fma(x01, k01, acc)
        acc = tl.fma(x10, k10, acc)
        acc = tl.fma(x11, k11, acc)
        acc = tl.fma(x20, k20, acc)
        acc = tl.fma(x21, k21, acc)
        acc = tl.fma(x30, k30, acc)
        acc = tl.fma(x31, k31, acc)
    else:
        x_lo, x_hi = _top_halves(x)
        k_lo, k_hi = _top_halves(kx)
        acc = tl.fma(x_hi, k_hi, _mul_rn(x_lo, k_lo, USE_PTX))
    for _ in tl.static_range(LOG2_MAX_BK):
        if acc.shape[0] > 1:
            acc = _fold_halves(acc)
    if len(x.shape) == 1:
        return tl.reshape(acc, ())
    else:
        return tl.reshape(acc, (x.shape[1],))


@triton.jit
def l2_normalize(x, USE_PTX: tl.constexpr):
    """``x * rsqrt(sum(x * x) + 1e-6)`` in fp32 for a ``[BK]`` vector (docs/design.md section
    2.3; the reference divides, ``x / sqrt(.)``), the sum taken by :func:`kdot` (an order of
    the code's, so ``k̂`` has the same bits in every tile and wherever Triton rematerializes it).

    One multiply per element instead of an IEEE division and square root. On CUDA ``rsqrt``
    is ``rsqrt.approx.ftz.f32`` (2 ulp), so ``k̂`` and ``q̂`` land within about 3 ulp of the
    quotient (the Triton interpreter computes an IEEE ``1/sqrt``). Measured faster than the
    division on the H200 (docs/perf-notes.md). Bit identity is unaffected: ``k̂`` has the same
    bits in verify, the snapshot and the fold (the same code), is recorded, and replayed by
    commit; ``q̂`` only reaches the output.
    """
    return x * tl.rsqrt(kdot(x, x, USE_PTX) + L2NORM_EPS)


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
def gdn_correction(b_p, b_k, b_v, b_beta, USE_PTX: tl.constexpr):
    """``u = beta * (v - P^T k̂)``: ``[BV]`` from ``P [BK, BV]``, ``k̂ [BK]``, ``v [BV]``; the
    K reduction is :func:`kdot` (its order is the code's, whatever the tile)."""
    return b_beta * (b_v - kdot(b_p, b_k, USE_PTX))


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


@triton.jit
def load_record_token(ru_ptr, rk_ptr, rd_ptr, tok, end, i_h, i_hv, o_k, o_v, m_k, m_v,
                      s_rut, s_ruh, s_ruv, s_rkt, s_rkh, s_rkk, s_rdt, s_rdh):
    """Replay record of token ``tok`` for one program: ``k̂ [BK], u [BV], decay`` (fp32), zeros
    unless ``tok < end`` (a prefetch past the last accepted token reads nothing). Commit and
    the folded verify load the next token's record while they apply this one. The vector
    masks compare per lane: Triton 3.6's interpreter rejects a vector mask combined with a
    scalar one."""
    b_k = tl.load(rk_ptr + tok * s_rkt + i_h * s_rkh + o_k * s_rkk, mask=m_k & (o_k * 0 + tok < end), other=0)
    b_u = tl.load(ru_ptr + tok * s_rut + i_hv * s_ruh + o_v * s_ruv, mask=m_v & (o_v * 0 + tok < end), other=0)
    b_d = tl.load(rd_ptr + tok * s_rdt + i_hv * s_rdh, mask=tok < end, other=0)
    return b_k, b_u, b_d


@triton.jit
def replay_token(b_h, b_k, b_u, b_d, USE_PTX: tl.constexpr):
    """One recorded token applied to a ``[BK, BV]`` fp32 state tile:
    ``fma(k̂, u, S * d)`` (:func:`gdn_decay` then :func:`gdn_apply`), commit's and the fold's
    update."""
    return gdn_apply(gdn_decay(b_h, b_d, USE_PTX), tl.broadcast_to(b_k[:, None], b_h.shape), b_u, USE_PTX)


_USE_PTX = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True") and torch.version.hip is None


def use_ptx() -> bool:
    """Whether the kernels may use PTX inline assembly: not under the Triton interpreter (which
    must be chosen before import, so this is decided once, off the launch path) nor on ROCm."""
    return _USE_PTX


@triton.jit
def pin(x, USE_PTX: tl.constexpr):
    """An opaque identity: every later use of ``x`` (the record store and the state update)
    reads these very registers (cheap for a ``[BV]`` vector; measured costly on a whole tile,
    docs/perf-notes.md). Without it Triton may rematerialize the producer chain of a value in
    another layout for one of its uses, and a rematerialized reduction sums in another order."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=False, pack=1)
    else:
        return x
