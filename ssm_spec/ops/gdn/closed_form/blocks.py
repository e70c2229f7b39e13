"""Register-block helpers of the closed-form kernel: exact selections (a row, a column, an
entry: sums of one value and zeros) and FMA chains in an order written in code."""

from __future__ import annotations

import triton
import triton.language as tl

from ..inner import L2NORM_EPS, _top_halves, kdot_pairs


@triton.jit
def _row(m, o_w, t):
    """Row ``t`` of ``m [WP, N]``: a sum of one value and zeros, so exact in any order."""
    return tl.sum(tl.where(o_w[:, None] == t, m, 0.0), axis=0)


@triton.jit
def _col(m, o_c, j):
    """Column ``j`` of ``m [M, N]`` (``o_c = arange(N)``), exact as :func:`_row`."""
    return tl.sum(tl.where(o_c[None, :] == j, m, 0.0), axis=1)


@triton.jit
def _at(vec, o_w, t):
    """Entry ``t`` of ``vec`` (exact, as :func:`_row`)."""
    return tl.sum(tl.where(o_w == t, vec, 0.0), axis=0)


@triton.jit
def _cols(m, o_n, idx):
    """Columns ``idx [M]`` of ``m [P, N]`` as the rows of an ``[M, P]`` block (``o_n =
    arange(N)``; an index outside gives zeros), exact as :func:`_row`."""
    return tl.sum(tl.where(o_n[None, None, :] == idx[:, None, None], m[None, :, :], 0.0), axis=2)


@triton.jit
def _squeeze_row(x):
    """``x [1, N] -> [N]``."""
    return tl.reshape(x, (x.shape[1],))


@triton.jit
def _chain1(acc, x, s):
    """``acc + x[0] s[0]^T`` for one row (``x [1, WP]``, ``s [1, BV]``): one rank-1 FMA. The
    ``_chainN`` ladder halves the rows down to it (Triton's JIT does not recurse over shapes)."""
    return tl.fma(_squeeze_row(x)[:, None], _squeeze_row(s)[None, :], acc)


@triton.jit
def _chain2(acc, x, s):
    """Two rows, row 0 first (the rows are a thread's registers: the split moves nothing)."""
    x0, x1 = _top_halves(x)
    s0, s1 = _top_halves(s)
    return _chain1(_chain1(acc, x0, s0), x1, s1)


@triton.jit
def _chain4(acc, x, s):
    x0, x1 = _top_halves(x)
    s0, s1 = _top_halves(s)
    return _chain2(_chain2(acc, x0, s0), x1, s1)


@triton.jit
def _chain8(acc, x, s):
    x0, x1 = _top_halves(x)
    s0, s1 = _top_halves(s)
    return _chain4(_chain4(acc, x0, s0), x1, s1)


@triton.jit
def _chain16(acc, x, s):
    x0, x1 = _top_halves(x)
    s0, s1 = _top_halves(s)
    return _chain8(_chain8(acc, x0, s0), x1, s1)


@triton.jit
def _chain32(acc, x, s):
    x0, x1 = _top_halves(x)
    s0, s1 = _top_halves(s)
    return _chain16(_chain16(acc, x0, s0), x1, s1)


@triton.jit
def chain_rows(acc, x, s):
    """``acc + x^T s`` for ``x [N, M]``, ``s [N, P]``, ``acc [M, P]`` (``N`` a power of two up
    to 32): one FMA per product, rows in order (a chunk of state rows and the window's key
    entries on them, or pending records). Chained over the chunks of a ``K`` loop, each output
    is one FMA chain over the key axis in index order, whatever the tile."""
    if x.shape[0] == 32:
        return _chain32(acc, x, s)
    elif x.shape[0] == 16:
        return _chain16(acc, x, s)
    elif x.shape[0] == 8:
        return _chain8(acc, x, s)
    elif x.shape[0] == 4:
        return _chain4(acc, x, s)
    elif x.shape[0] == 2:
        return _chain2(acc, x, s)
    else:
        return _chain1(acc, x, s)


@triton.jit
def _or_neg_zero(m, x):
    """``x`` where ``m``, else ``-0.0``: as the multiplier of a masked record's term it adds
    exactly nothing (``y + (-0.0) == y`` for every ``y``; a ``+0.0`` term turns a ``-0.0`` into
    ``+0.0``). Made from its bits: compiled Triton makes a ``-0.0`` literal ``+0.0`` (a zero
    constant is its null value); the interpreter keeps the sign."""
    return tl.where(m, x, tl.full(x.shape, -2147483648, tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _ring_pos(i, R):
    """``i mod R`` without a division, for ``0 <= i < 2R``: a pending record's ring position
    from the start (``< R``) plus its index (``< pn <= R``); a larger ``i`` names only masked
    records, which read nothing. int32, as offsets within one slot's ring (``< 2^31`` elements)."""
    return tl.where(i >= R, i - R, i)


@triton.jit
def _load_u(ru_row, pos, m_f, o_v, m_v, s_rut, s_ruv):
    """The ``u`` rows ``[M, BV]`` of a block of ring positions ``pos [M]``; zeros where ``m_f``
    is false (the position holds no pending record: whatever it holds is never read)."""
    return tl.load(ru_row + pos[:, None] * s_rut + o_v[None, :] * s_ruv, mask=m_f[:, None] & m_v[None, :], other=0)


@triton.jit
def _fold_block(b_s, rk_row, ru_row, pos, m_f, e_f, rows, m_r, o_v, m_v, s_rkt, s_rkk, s_rut, s_ruv):
    """``b_s + sum_j e_f[j] k̂_j[rows] u_j^T`` over a block of pending records (ring positions
    ``pos [M]``), one FMA per record and element in record order (:func:`chain_rows`); the
    block's ``k̂`` and ``u`` rows are loaded together. A record with ``m_f`` false adds exactly
    nothing: its loads are zeros and ``e_f`` must be ``-0.0`` there (:func:`_or_neg_zero`), so
    its term is ``-0.0``."""
    kpT = tl.load(rk_row + pos[:, None] * s_rkt + rows[None, :] * s_rkk, mask=m_f[:, None] & m_r[None, :], other=0)
    return chain_rows(b_s, kpT * e_f[:, None], _load_u(ru_row, pos, m_f, o_v, m_v, s_rut, s_ruv))


@triton.jit
def _window_keys(k_ptr, q_ptr, tok, i_h, o_k, m_k, m_w, s_kt, s_kh, s_kk, s_qt, s_qh, s_qk,
                 USE_QK_L2NORM: tl.constexpr, USE_PTX: tl.constexpr):
    """The window's keys and queries, ``[BK, WP]`` fp32 (column ``t``: token ``t``; padding
    columns zero), normalised (``k̂``, ``q̂`` before the scale), and their inverse norms
    ``[WP]`` (ones without the normalisation). The norms are :func:`~ssm_spec.ops.gdn.inner.kdot`
    column by column, so ``k̂`` has the bits of :func:`~ssm_spec.ops.gdn.inner.l2_normalize`."""
    m = m_k[:, None] & m_w[None, :]
    kr = tl.load(k_ptr + tok[None, :] * s_kt + i_h * s_kh + o_k[:, None] * s_kk, mask=m, other=0).to(tl.float32)
    qr = tl.load(q_ptr + tok[None, :] * s_qt + i_h * s_qh + o_k[:, None] * s_qk, mask=m, other=0).to(tl.float32)
    if USE_QK_L2NORM:
        ik = tl.rsqrt(kdot_pairs(kr, kr, USE_PTX) + L2NORM_EPS)
        iq = tl.rsqrt(kdot_pairs(qr, qr, USE_PTX) + L2NORM_EPS)
    else:
        ik = tl.full([kr.shape[1]], 1.0, tl.float32)
        iq = tl.full([kr.shape[1]], 1.0, tl.float32)
    return kr * ik[None, :], qr * iq[None, :], ik, iq
