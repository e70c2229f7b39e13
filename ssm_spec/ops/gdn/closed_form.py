"""Fast mode (docs/design.md section 2.6): the closed-form window verify and its lazy folded form.

``gdn_closed_form_verify`` computes a window's outputs and replay record from a read-only
checkpoint without the token loop's dependent chain: the state streams through once, in chunks
of key rows, and is contracted against the window's keys and queries (``2W`` products over
``K``, one FMA chain per output in key order), and the corrections solve the ``W x W`` unit
lower-triangular system in registers (:mod:`ssm_spec.reference_closed_form` is its float64
oracle). Its record is the exact verify's (fp32 ``u``, ``k̂``, ``d = exp(g)``), so
``gdn_commit`` and the grouped commit replay it.

``gdn_closed_form_folded_verify`` is the lazy commit's verify. Each slot owns a ring of
``R = max(max_pending, max_window) + max_window`` record positions (``u``, ``k̂`` and the log
decay ``g``) and keeps its last ``p <= max(max_pending, W)`` accepted tokens there instead of in
its state. Per row: if ``p > 0`` and ``p + W > max_pending`` (the window's accepted tokens could
pass ``max_pending``), the kernel adds the ``p`` pending tokens to each state chunk in closed
form, ``S_P = exp(G_P) S0 + sum_p exp(G_P - G_p) k̂_p u_p^T``, and stores it once (the fold);
otherwise it reads the state only and adds the pending tokens to the window's contractions in
closed form. Either way it then solves the window and appends the window's records right after
the pending ones. ``max_pending = 1`` folds at every step that has something pending: the
folded commit of fast mode.

Not bit-identical to the token loop (other roundings; the contract is a bound on the error
against a float64 run, tested). Every sum has an order written in code (key-order FMA chains,
:func:`~ssm_spec.ops.gdn.inner.kdot` for the norms and the Gram rows, token-order chains over
window and history tokens, explicit FMAs where a contraction could otherwise depend on the
layout), so bits do not depend on the tile or the batch.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import reference, reference_closed_form
from .. import _eager
from .._validate import (
    check_index,
    check_tensor,
    check_unaliased_pool,
    check_write_conflicts,
    fail,
    slot_values,
    window_bounds,
)
from .._window import clamped_window, load_window
from .inner import (
    L2NORM_EPS,
    _top_halves,
    check_tile,
    gdn_tile_config,
    kdot,
    kdot_pairs,
    next_power_of_2,
    use_ptx,
)
from .verify import ReplayRecord, check_gdn_window_structure, prepare_window_call

# ----------------------------------------------------------------------------- Triton


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


@triton.jit(do_not_specialize=["T", "S", "R", "L", "PMAX"])
def gdn_closed_form_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, qsl_ptr, out_ptr,
    ru_ptr, rk_ptr, rg_ptr, pstart_ptr, pcount_ptr,
    scale, T, S, R, L, PMAX,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_bt, s_bh,
    s_ss, s_sh, s_sk, s_sv, s_slot, s_qsl, s_ot, s_oh, s_ov,
    s_rus, s_rut, s_ruh, s_ruv, s_rks, s_rkt, s_rkh, s_rkk, s_rgs, s_rgt, s_rgh, s_ps, s_pc,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, WP: tl.constexpr,
    PP: tl.constexpr, KH: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, USE_PTX: tl.constexpr, RING: tl.constexpr,
):
    """One program per (V tile, row x value head); the state streams through in chunks of
    ``KC`` key rows and is read once.

    Per chunk: the rows ``S[c] [KC, BV]`` and the window's raw keys and queries on those rows;
    ``A_K += K[c]^T S[c]``, ``A_Q += Q[c]^T S[c]`` as rank-1 FMAs (:func:`chain_rows`: each
    output one FMA chain over the key axis in index order). Then ``K̂ S = diag(1/|k|) A_K``,
    ``Q̂ S = scale diag(1/|q|) A_Q``. In the plain form nothing but a chunk and the two
    ``[WP, BV]`` accumulators is live in the loop (the ring forms add the ``[WP, PP]`` products
    with the pending keys, or one fold block), so many programs are resident and their loads
    overlap.

    ``RING=True`` (the lazy commit, module docstring): a row that folds (``p > 0`` and
    ``p + W > L``) rebuilds each chunk as ``S_P = exp(G_P) S0 + sum_p exp(G_P - G_p) k̂_p u_p^T``
    (decays as exp of differences, at most 1; one FMA per pending token and element), stores it
    once in the pool's dtype and continues from the stored value; a row that does not fold adds
    its ``p`` pending tokens to the contractions in closed form after the loop,
    ``X S_P = exp(G_P) X S0 + sum_p exp(G_P - G_p) (X k̂_p) u_p^T`` (``X`` the window's ``k̂`` or
    ``q̂``; ``O(p W (K + V))`` work, the state untouched).

    Then the ``W x W`` system on ``[WP, WP]`` register matrices: the Gram rows by
    :func:`~ssm_spec.ops.gdn.inner.kdot`, ``T = (I + A)^-1`` by rows in token order,
    ``C = (D o QK) T``, ``U = T R`` and the outputs as rank-1 updates in token order. Every sum
    has an order of the code's, so the bits do not depend on the tile (``BV``, ``num_warps``).
    The window (at most ``WP`` tokens; validation rejects longer ones, the kernel cuts them) has
    zero padding rows (zero key, query and beta), which reach no valid output.

    ``RING=False``: records go to token rows ``[T, ...]`` (third field ``d = exp(g)``) and the
    state is read only. ``RING=True``: records go to the slot's ring ``[S, R, ...]`` right after
    the pending ones (third field ``g``)."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(slot_ptr + i_b * s_slot).to(tl.int64)
    bos, eos = load_window(qsl_ptr, i_b, s_qsl, T)
    eos = tl.minimum(eos, bos + WP)
    W = eos - bos
    if (slot >= 0) & (slot < S):
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        o_w = tl.arange(0, WP)
        o_c = tl.arange(0, KC)
        m_k = o_k < K
        m_v = o_v < V
        m_w = o_w < W
        tok = bos.to(tl.int64) + o_w  # int64 token offsets
        base = state_ptr + slot * s_ss + i_hv * s_sh
        wpos = 0
        fold = False
        hist = False
        if RING:
            o_p = tl.arange(0, PP)
            p0 = tl.minimum(tl.maximum(tl.load(pstart_ptr + i_b * s_ps), 0), R - 1)
            pn = tl.minimum(tl.maximum(tl.load(pcount_ptr + i_b * s_pc), 0), PMAX)  # PMAX = R - max_window <= PP
            wpos = (p0 + pn) % R
            m_p = o_p < pn
            pos_p = ((p0 + o_p) % R).to(tl.int64)
            g_p = tl.load(rg_ptr + slot * s_rgs + pos_p * s_rgt + i_hv * s_rgh, mask=m_p, other=0)
            Gp = tl.zeros([PP], dtype=tl.float32)  # G_p = g_0 + ... + g_p, a chain in history order
            gc = _at(g_p, o_p, 0)
            for j in tl.static_range(PP):
                if j > 0:
                    gc += _at(g_p, o_p, j)
                Gp = tl.where(o_p >= j, gc, Gp)
            GP = gc  # padding entries add zeros
            e_p = _or_neg_zero(m_p, tl.exp(GP - Gp))  # exp(G_P - G_p) <= 1; -0.0: _fold_block
            rk_row = rk_ptr + slot * s_rks + i_h * s_rkh
            ru_row = ru_ptr + slot * s_rus + i_hv * s_ruh
            o_4 = tl.arange(0, 4)  # a block of 4 records (the history; the fold beyond PP = 4)
            if PP > 4:  # the fold's decays by blocks of 4 records, row b: records 4b .. 4b + 3
                e_b = tl.reshape(e_p, (PP // 4, 4))
                o_b = tl.arange(0, PP // 4)
            fold = (pn > 0) & (pn + W > L)
            hist = (pn > 0) & (pn + W <= L)
        # ---- the window's normalised keys and queries, the Gram rows, the record's k̂
        KmT, QmT, ik, iq = _window_keys(k_ptr, q_ptr, tok, i_h, o_k, m_k, m_w, s_kt, s_kh, s_kk, s_qt, s_qh, s_qk,
                                        USE_QK_L2NORM, USE_PTX)
        o_r = o_w[:, None]
        KK = tl.zeros([WP, WP], dtype=tl.float32)  # row t: k̂_t . k̂_j
        QK = tl.zeros([WP, WP], dtype=tl.float32)  # row t: q̂_t . k̂_j (before the scale)
        for t in tl.static_range(WP):
            KK = tl.where(o_r == t, kdot(KmT, _col(KmT, o_w, t), USE_PTX)[None, :], KK)
            QK = tl.where(o_r == t, kdot(KmT, _col(QmT, o_w, t), USE_PTX)[None, :], QK)
        QK = QK * scale
        if (i_v == 0) & (i_hv % (HV // H) == 0):  # the record's k̂, once per key head
            m_kw = m_k[:, None] & m_w[None, :]
            if RING:
                rpos = ((wpos + o_w) % R).to(tl.int64)
                tl.store(rk_ptr + slot * s_rks + rpos[None, :] * s_rkt + i_h * s_rkh + o_k[:, None] * s_rkk, KmT,
                         mask=m_kw)
            else:
                tl.store(rk_ptr + tok[None, :] * s_rkt + i_h * s_rkh + o_k[:, None] * s_rkk, KmT, mask=m_kw)
        # ---- the state, once, in chunks of KC key rows: A_K = K^T S, A_Q = Q^T S (raw k, q)
        AK = tl.zeros([WP, BV], dtype=tl.float32)
        AQ = tl.zeros([WP, BV], dtype=tl.float32)
        if (W > 0) | fold:
            # a runtime loop: one chunk's registers live at a time; STAGES > 1 lets Triton's
            # pipeliner copy the next chunks' loads to shared memory while this one computes;
            # PREFETCH loads the next chunk's state rows into registers before this chunk's FMAs
            # (by hand: the loads stay in flight while the chunk computes)
            if PREFETCH:
                m_n = o_c < K
                b_n = tl.load(base + o_c[:, None] * s_sk + o_v[None, :] * s_sv, mask=m_n[:, None] & m_v[None, :],
                              other=0)
            for c in tl.range(0, BK // KC, num_stages=STAGES):
                rows = c * KC + o_c
                m_r = rows < K
                m_s = m_r[:, None] & m_v[None, :]
                if PREFETCH:
                    b_s = b_n.to(tl.float32)
                    m_n = (rows + KC) < K  # past the last chunk: masked, no traffic
                    b_n = tl.load(base + (rows + KC)[:, None] * s_sk + o_v[None, :] * s_sv,
                                  mask=m_n[:, None] & m_v[None, :], other=0)
                else:
                    b_s = tl.load(base + rows[:, None] * s_sk + o_v[None, :] * s_sv, mask=m_s, other=0).to(
                        tl.float32)
                if RING:
                    if fold:  # S_P = exp(G_P) S0 + sum_p exp(G_P - G_p) k̂_p u_p^T, stored once
                        b_s = b_s * tl.exp(GP)
                        if PP <= 4:  # every record at once: one rank-PP update
                            b_s = _fold_block(b_s, rk_row, ru_row, pos_p, m_p, e_p, rows, m_r, o_v, m_v,
                                              s_rkt, s_rkk, s_rut, s_ruv)
                        else:  # a runtime loop over blocks of 4 records: one block's registers live
                            for i0 in range(0, pn, 4):
                                o_f = i0 + o_4
                                m_f = o_f < pn
                                b_s = _fold_block(b_s, rk_row, ru_row, _ring_pos(p0 + o_f, R), m_f,
                                                  _or_neg_zero(m_f, _row(e_b, o_b, i0 // 4)), rows, m_r, o_v, m_v,
                                                  s_rkt, s_rkk, s_rut, s_ruv)
                        b_st = b_s.to(state_ptr.dtype.element_ty)
                        tl.store(base + rows[:, None] * s_sk + o_v[None, :] * s_sv, b_st, mask=m_s)
                        b_s = b_st.to(tl.float32)
                m_rw = m_r[:, None] & m_w[None, :]
                x_k = tl.load(k_ptr + tok[None, :] * s_kt + i_h * s_kh + rows[:, None] * s_kk, mask=m_rw,
                              other=0).to(tl.float32)
                x_q = tl.load(q_ptr + tok[None, :] * s_qt + i_h * s_qh + rows[:, None] * s_qk, mask=m_rw,
                              other=0).to(tl.float32)
                AK = chain_rows(AK, x_k, b_s)
                AQ = chain_rows(AQ, x_q, b_s)
        KS = AK * ik[:, None]
        QS = (AQ * iq[:, None]) * scale
        if RING:
            if hist:  # X S_P = exp(G_P) X S0 + sum_p exp(G_P - G_p) (X k̂_p) u_p^T
                # the window's raw keys and queries against the pending k̂, [WP, PP], in a loop of
                # their own after the state's (live beside the state chunk they spilled): one FMA
                # chain per product over the key axis in index order, as before (same bits)
                Dk = tl.zeros([WP, PP], dtype=tl.float32)
                Dq = tl.zeros([WP, PP], dtype=tl.float32)
                for c in range(0, BK // KH):
                    rows = c * KH + tl.arange(0, KH)
                    m_r = rows < K
                    m_rw = m_r[:, None] & m_w[None, :]
                    x_k = tl.load(k_ptr + tok[None, :] * s_kt + i_h * s_kh + rows[:, None] * s_kk, mask=m_rw,
                                  other=0).to(tl.float32)
                    x_q = tl.load(q_ptr + tok[None, :] * s_qt + i_h * s_qh + rows[:, None] * s_qk, mask=m_rw,
                                  other=0).to(tl.float32)
                    kp = tl.load(rk_row + pos_p[None, :] * s_rkt + rows[:, None] * s_rkk,
                                 mask=m_r[:, None] & m_p[None, :], other=0)
                    Dk = chain_rows(Dk, x_k, kp)
                    Dq = chain_rows(Dq, x_q, kp)
                eGP = tl.exp(GP)
                KS = KS * eGP
                QS = QS * eGP
                CK = (Dk * ik[:, None]) * e_p[None, :]
                CQ = ((Dq * iq[:, None]) * scale) * e_p[None, :]
                for i0 in range(0, pn, 4):  # blocks of 4 records, rank-1 FMAs in record order
                    o_f = i0 + o_4
                    m_f = o_f < pn  # records past pn: a -0.0 term each, exactly nothing (_or_neg_zero)
                    u_f = _load_u(ru_row, _ring_pos(p0 + o_f, R), m_f, o_v, m_v, s_rut, s_ruv)
                    KS = chain_rows(KS, _or_neg_zero(m_f[:, None], _cols(CK, o_p, o_f)), u_f)
                    QS = chain_rows(QS, _or_neg_zero(m_f[:, None], _cols(CQ, o_p, o_f)), u_f)
        # ---- gates: cumulative log decays of the window (a chain in token order, in both
        # orientations), betas
        b_g = tl.load(g_ptr + tok * s_gt + i_hv * s_gh, mask=m_w, other=0).to(tl.float32)
        b_beta = tl.load(beta_ptr + tok * s_bt + i_hv * s_bh, mask=m_w, other=0).to(tl.float32)
        Gw = tl.zeros([WP], dtype=tl.float32)
        Gw_r = tl.zeros([1, WP], dtype=tl.float32)
        gc = _at(b_g, o_w, 0)
        for j in tl.static_range(WP):
            if j > 0:
                gc += _at(b_g, o_w, j)
            Gw = tl.where(o_w >= j, gc, Gw)
            Gw_r = tl.where(o_w[None, :] >= j, gc, Gw_r)
        # ---- the W x W system: T = (I + A)^-1 (unit lower triangular, rows by forward
        # substitution), C = (D o QK) T; D_tj = exp(G_t - G_j) <= 1 on and below the diagonal
        causal = o_r >= o_w[None, :]
        Dm = tl.where(causal, tl.exp(tl.where(causal, Gw[:, None] - Gw_r, 0.0)), 0.0)
        A = tl.where(o_r > o_w[None, :], b_beta[:, None] * Dm * KK, 0.0)
        DQ = Dm * QK
        Tm = tl.zeros([WP, WP], dtype=tl.float32)
        for t in tl.static_range(WP):
            a_t = _row(A, o_w, t)
            row = tl.where(o_w == t, 1.0, 0.0)
            for j in tl.static_range(t):
                row = tl.fma(-_at(a_t, o_w, j), _row(Tm, o_w, j), row)
            Tm = tl.where(o_r == t, row[None, :], Tm)
        Cm = tl.zeros([WP, WP], dtype=tl.float32)
        for j in tl.static_range(WP):
            Cm = tl.fma(_col(DQ, o_w, j)[:, None], _row(Tm, o_w, j)[None, :], Cm)
        # ---- U = T R and O = exp(G) Q S + C R, with R = diag(beta) (V - exp(G) K S)
        eG = tl.exp(Gw)
        b_v = tl.load(v_ptr + tok[:, None] * s_vt + i_hv * s_vh + o_v[None, :] * s_vv,
                      mask=m_w[:, None] & m_v[None, :], other=0).to(tl.float32)
        Rm = b_beta[:, None] * tl.fma(-eG[:, None], KS, b_v)  # one rounding whatever the layouts
        U = tl.zeros([WP, BV], dtype=tl.float32)
        O = eG[:, None] * QS
        for j in tl.static_range(WP):
            r_j = _row(Rm, o_w, j)[None, :]
            U = tl.fma(_col(Tm, o_w, j)[:, None], r_j, U)
            O = tl.fma(_col(Cm, o_w, j)[:, None], r_j, O)
        # ---- stores: outputs, the record (u by every V tile, the gate once)
        m_o = m_w[:, None] & m_v[None, :]
        tl.store(out_ptr + tok[:, None] * s_ot + i_hv * s_oh + o_v[None, :] * s_ov, O.to(out_ptr.dtype.element_ty),
                 mask=m_o)
        if RING:
            rpos = ((wpos + o_w) % R).to(tl.int64)
            tl.store(ru_ptr + slot * s_rus + rpos[:, None] * s_rut + i_hv * s_ruh + o_v[None, :] * s_ruv, U, mask=m_o)
            if i_v == 0:
                tl.store(rg_ptr + slot * s_rgs + rpos * s_rgt + i_hv * s_rgh, b_g, mask=m_w)
        else:
            tl.store(ru_ptr + tok[:, None] * s_rut + i_hv * s_ruh + o_v[None, :] * s_ruv, U, mask=m_o)
            if i_v == 0:
                tl.store(rg_ptr + tok * s_rgt + i_hv * s_rgh, tl.exp(b_g), mask=m_w)


#: Register cap of the closed-form kernel (``maxnreg``): 16 one-warp programs per SM, so their
#: state loads overlap. Measured on the H200 (docs/perf-notes.md, fast mode v4, B=64): the ring
#: forms ran at 227-255 registers without it; with it a fold of 4 pending took 123 us instead of
#: 179 us, and the plain W=8 76 us instead of 89 us. Not passed to the Triton interpreter.
MAX_REGISTERS = 128


def key_chunk(BK: int, WP: int) -> int:
    """Key rows per chunk of the closed-form kernel's state loop (a power of two <= ``BK``), the
    same for the plain and the ring forms.

    The window's keys and queries on a chunk, ``2 * KC * WP`` values, are replicated in every
    thread, so past a window block of 4 the chunk shrinks as the window grows (a block of 1 keeps
    4 rows: not measured at 8). Measured on the H200 (B=64, fp32, docs/perf-notes.md): plain W=4
    8 rows 44.0 us (4 rows 47.4), W=2 8 rows 39.5 (4 rows 40.7, 16 rows 49.8; 2026-12-02), W=8 4
    rows 76.2 (2 rows 116, 8 rows 179). The ring forms (fold, history), kernel v6 (history
    products in their own loop), H200 2026-12-02, ``scripts/tune_closed_form.py --ring-key-rows
    4,8``: 8 rows for W = 2..4 (fold of 15 pending under max_pending 16: W=4 129.6 us, 4 rows
    172.7; W=2 111.0 vs 148.2; folded W=4 90.3 vs 96.0; history within 1.5 us either way), 4 rows
    for W=8 (8 rows spill: fold 459.7 vs 227.1). Bits do not depend on it (one FMA chain over the
    key axis whatever the chunk)."""
    kc = 8 if WP in (2, 4) else (4 if WP <= 8 else 2)
    return max(1, min(kc, BK))


def history_chunk(BK: int) -> int:
    """Key rows per chunk of the history path's loop (the window's raw keys and queries against
    the pending ``k̂``, after the state loop). Bits do not depend on it (one FMA chain over the
    key axis whatever the chunk)."""
    return max(1, min(HISTORY_CHUNK, BK))


#: Key rows per chunk of the history products' loop (:func:`history_chunk`).
HISTORY_CHUNK = 4

#: ``num_stages`` of the state loop (``tl.range``): 1 compiles the loop as before (the same
#: instructions as a plain ``range``, offline); 2 makes Triton copy the next chunk's state and
#: keys to shared memory asynchronously (``LDGSTS``) while the current chunk computes, at the
#: cost of more registers (offline, sm_90, ring L=1 W=4 at 8 rows: 27 -> 66 local-memory
#: instructions). Measured on the H200 (B=64, fp32, 2026-12-02, docs/perf-notes.md "v7"): 2
#: stages lost or tied in every form (W=4: history 75.9 vs 66.6 us, fold of 15 pending 141.4 vs
#: 129.6, folded 90.1 vs 89.8, plain 45.1 vs 44.4). Bits do not depend on it (same arithmetic in
#: the same order; the sweep checks them).
STATE_STAGES = 1

#: Whether the state loop loads the next chunk's state rows into registers before the current
#: chunk's FMAs (``PREFETCH``), so each program keeps a chunk's loads in flight while it computes.
#: Costs one more chunk of registers. Measured on the H200 (B=64, fp32, 2026-12-02,
#: docs/perf-notes.md "v8"): at each form's default chunk slower or within noise (W=4: plain 44.5
#: -> 55.6 us, fold of 15 pending 129.8 -> 156.4, folded 90.5 -> 109.5; bf16 plain 37.6 -> 37.2),
#: so off. Bits do not depend on it (the same values reach the same FMAs; the sweep checks them).
STATE_PREFETCH = False


def window_block(max_window: int) -> int:
    """The kernel's window block ``WP = next_pow2(max(1, max_window))`` (a constexpr: one
    binary per power of two)."""
    return next_power_of_2(max(1, int(max_window)))


def pending_block(positions: int, max_window: int) -> int:
    """The kernel's pending block ``PP = next_pow2(R - max_window)`` (at least 1). A valid pending
    count is at most ``R - max_window`` (validated); kernel and twin clamp a count to that, so the
    window's records never overwrite a pending record another program may still read, and an
    unvalidated count gives the same result in every tile."""
    return next_power_of_2(max(1, int(positions) - int(max_window)))


def ring_positions(max_pending: int, max_window: int) -> int:
    """Ring positions a slot needs: ``max(max_pending, max_window) + max_window`` (at least 1).

    A row's pending tokens never pass ``max(max_pending, W)`` (a row under the bound keeps at
    most ``max_pending``; a row that folds keeps only its new accepted tokens), and the window's
    records go right after them, never over a pending record another program may still read."""
    return max(1, max(max_pending, max_window) + max_window)


def _check_int(name: str, value, upper: int | None = None) -> None:
    """``value`` is None or an int (not a bool) in ``1..upper``; else a ``ValueError`` naming it."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"launch_closed_form: {name}: got {value!r}; expected an int")
    if upper is not None and not 0 < int(value) <= upper:
        raise ValueError(f"launch_closed_form: {name}: got {value!r}; expected an int in 1..{upper}")


def block_constants(BK: int, max_window: int, positions: int, ring: bool, key_rows: int | None = None,
                    stages: int | None = None, prefetch: bool | None = None) -> dict:
    """The block constexprs of :func:`gdn_closed_form_kernel` for a launch (and for
    ``scripts/offline_sass.py``, which compiles the same binary): ``WP`` (:func:`window_block`),
    ``PP`` (:func:`pending_block` of the ring's ``positions``; 1 without a ring), ``KC``
    (:func:`key_chunk`, or ``key_rows``), ``KH`` (:func:`history_chunk`), ``STAGES`` (the
    state loop's ``num_stages``: :data:`STATE_STAGES`, or ``stages``) and ``PREFETCH`` (the
    next chunk's state rows loaded a chunk ahead: :data:`STATE_PREFETCH`, or ``prefetch``).

    Raises:
        ValueError: ``key_rows`` not a power of two in ``1..BK``; ``stages`` below 1; either not
            an ``int``; ``prefetch`` not a bool.
    """
    _check_int("key_rows", key_rows)
    _check_int("stages", stages)
    WP = window_block(max_window)
    KC = key_chunk(BK, WP) if key_rows is None else int(key_rows)
    if KC < 1 or KC > BK or KC & (KC - 1):
        raise ValueError(f"launch_closed_form: key_rows: got {key_rows}; expected a power of two <= BK ({BK})")
    STAGES = STATE_STAGES if stages is None else int(stages)
    if STAGES < 1:
        raise ValueError(f"launch_closed_form: stages: got {stages}; expected 1 or more")
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(f"launch_closed_form: prefetch: got {prefetch!r}; expected a bool")
    return dict(WP=WP, PP=pending_block(positions, max_window) if ring else 1, KC=KC, KH=history_chunk(BK),
                STAGES=STAGES, PREFETCH=STATE_PREFETCH if prefetch is None else prefetch)


def launch_closed_form(q, k, v, g, beta, state, slots, query_start_loc, out, record, max_window, scale,
                       use_qk_l2norm, pending=None, config=None, max_registers=None, key_rows=None, stages=None,
                       prefetch=None):
    """Launch :func:`gdn_closed_form_kernel` (no allocation).

    ``record`` is ``(u, k, third)``: token rows ``[T, ...]`` with ``third = decay`` when
    ``pending`` is None, else the ring ``[S, R, ...]`` with ``third = g``; ``pending`` is
    ``(pending_start [B], pending_count [B], max_pending)``. ``config`` overrides the tile
    ``(BK, BV, num_warps)``, ``max_registers`` the register cap (default :data:`MAX_REGISTERS`;
    compiled launches only; an int in 1..255), ``key_rows`` the state loop's rows per chunk (a power of two
    ``<= BK``; default :func:`key_chunk`), ``stages`` its software-pipelining depth (default
    :data:`STATE_STAGES`; the interpreter ignores it) and ``prefetch`` whether it loads each chunk's
    state rows a chunk ahead (default :data:`STATE_PREFETCH`); bits depend on none of them.

    Raises:
        ValueError: a bad ``config``, ``max_registers``, ``key_rows``, ``stages`` or ``prefetch``, before
            anything is launched (with an empty batch too).
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = slots.shape[0]
    BK, BV, num_warps = (check_tile(config, K) if config is not None
                         else gdn_tile_config(K, V, "closed_form", state.dtype, B))
    _check_int("max_registers", max_registers, 255)
    ru, rk, rg = record
    if pending is None:
        pstart = pcount = slots
        R, L = 1, 0
        rec_strides = (0, *ru.stride(), 0, *rk.stride(), 0, *rg.stride())
    else:
        pstart, pcount, L = pending
        R = ru.shape[1]
        rec_strides = (*ru.stride(), *rk.stride(), *rg.stride())
    blocks = block_constants(BK, max_window, R, pending is not None, key_rows, stages, prefetch)  # checks them
    if B == 0:
        return
    grid = (triton.cdiv(V, BV), B * HV)
    gdn_closed_form_kernel[grid](
        q, k, v, g, beta, state, slots, query_start_loc, out, ru, rk, rg, pstart, pcount,
        float(scale), T, state.shape[0], R, int(L), max(0, R - int(max_window)),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        *state.stride(), slots.stride(0), query_start_loc.stride(0), *out.stride(),
        *rec_strides, pstart.stride(0), pcount.stride(0),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, **blocks, USE_QK_L2NORM=bool(use_qk_l2norm), USE_PTX=use_ptx(),
        RING=pending is not None, num_warps=num_warps,
        **({"maxnreg": int(max_registers or MAX_REGISTERS)} if use_ptx() else {}),
    )


# ----------------------------------------------------------------------------- CPU


def closed_form_cpu(q, k, v, g, beta, state, slots, query_start_loc, out, record, max_window, scale,
                    use_qk_l2norm, pending=None):
    """CPU twin of :func:`gdn_closed_form_kernel`: the float32 closed form of
    :func:`ssm_spec.reference_closed_form.gdn_closed_form_step` per row, the fold with the
    commit's update (:func:`ssm_spec.reference.gdn_replay_update`); the same clamping, window
    cut, fold rule and ring positions as the kernel."""
    T, S = q.shape[0], state.shape[0]
    HV, H = v.shape[1], q.shape[1]
    WP = window_block(max_window)
    qsl = query_start_loc.tolist()
    ru, rk, rg = record
    if pending is not None:
        starts, counts, L = pending[0].tolist(), pending[1].tolist(), pending[2]
        R = ru.shape[1]
    for b, slot in enumerate(slots.tolist()):
        bos, eos = clamped_window(qsl, b, T)
        eos = min(eos, bos + WP)
        if not 0 <= slot < S:
            continue
        s0 = state[slot].to(torch.float32)
        history = None
        if pending is not None:
            p0, pn = min(max(starts[b], 0), R - 1), min(max(counts[b], 0), max(0, R - max_window))
            pos = [(p0 + j) % R for j in range(pn)]
            if pn > 0 and pn + (eos - bos) > L:  # the fold
                h = s0.clone()
                for p in pos:
                    h = reference.gdn_replay_update(h, rk[slot, p].repeat_interleave(HV // H, 0), ru[slot, p],
                                                    torch.exp(rg[slot, p]))
                state[slot] = h
                s0 = state[slot].to(torch.float32)
            elif pn > 0:
                history = (ru[slot, pos], rk[slot, pos], rg[slot, pos])
            wpos = (p0 + pn) % R
        if eos == bos:
            continue
        res = reference_closed_form.gdn_closed_form_step(
            q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], s0, scale=scale,
            use_qk_l2norm=use_qk_l2norm, dtype=torch.float32, history=history)
        out[bos:eos] = res.out
        if pending is None:
            ru[bos:eos], rk[bos:eos], rg[bos:eos] = res.u, res.khat, res.decay
        else:
            for t in range(eos - bos):
                p = (wpos + t) % R
                ru[slot, p], rk[slot, p], rg[slot, p] = res.u[t], res.khat[t], g[bos + t]


# ----------------------------------------------------------------------------- checks


def _check_max_window(op, max_window):
    if isinstance(max_window, bool) or not isinstance(max_window, int) or max_window < 0:
        fail(op, "max_window", repr(max_window), "an int >= 0 (the longest window of the step)")


def _check_ring_structure(op, state, q, ring_u, ring_k, ring_g, pending_start, pending_count, max_window,
                          max_pending, batch):
    dev = state.device
    S, HV, K, V = state.shape
    H = q.shape[1]
    check_tensor(op, "ring_u", ring_u, ndim=4, dtypes=(torch.float32,), device=dev)
    R = ring_u.shape[1]
    check_tensor(op, "ring_u", ring_u, shape=(S, R, HV, V))
    check_tensor(op, "ring_k", ring_k, shape=(S, R, H, K), dtypes=(torch.float32,), device=dev)
    check_tensor(op, "ring_g", ring_g, shape=(S, R, HV), dtypes=(torch.float32,), device=dev)
    check_index(op, "pending_start", pending_start, batch, dev)
    check_index(op, "pending_count", pending_count, batch, dev)
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 0:
        fail(op, "max_pending", repr(max_pending), "an int >= 0")
    need = ring_positions(max_pending, max_window)
    if R < need:
        fail(op, "ring_u", f"{R} ring positions", f">= max(max_pending, max_window) + max_window = {need}")


# ----------------------------------------------------------------------------- the ops


def _gdn_closed_form_verify_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    out: torch.Tensor, rec_u: torch.Tensor, rec_k: torch.Tensor, rec_decay: torch.Tensor,
    max_window: int, scale: float, use_qk_l2norm: bool,
) -> None:
    """``torch.ops.ssm_spec.gdn_closed_form_verify`` (module docstring). CPU kernel; CUDA below."""
    _check_max_window("gdn_closed_form_verify", max_window)
    check_gdn_window_structure("gdn_closed_form_verify", q, k, v, g, beta, state, state_indices,
                               query_start_loc, out, rec_u, rec_k, rec_decay)
    closed_form_cpu(q, k, v, g, beta, state, state_indices, query_start_loc, out, (rec_u, rec_k, rec_decay),
                    max_window, scale, use_qk_l2norm)


gdn_closed_form_verify_op = torch.library.custom_op(
    "ssm_spec::gdn_closed_form_verify", mutates_args=("out", "rec_u", "rec_k", "rec_decay"))(
    _gdn_closed_form_verify_cpu)


@gdn_closed_form_verify_op.register_kernel("cuda")
def _gdn_closed_form_verify_cuda(q, k, v, g, beta, state, state_indices, query_start_loc, out, rec_u, rec_k,
                                 rec_decay, max_window, scale, use_qk_l2norm):
    _check_max_window("gdn_closed_form_verify", max_window)
    check_gdn_window_structure("gdn_closed_form_verify", q, k, v, g, beta, state, state_indices,
                               query_start_loc, out, rec_u, rec_k, rec_decay)
    launch_closed_form(q, k, v, g, beta, state, state_indices, query_start_loc, out, (rec_u, rec_k, rec_decay),
                       max_window, scale, use_qk_l2norm)


@gdn_closed_form_verify_op.register_fake
def _gdn_closed_form_verify_fake(*args, **kwargs):
    return None


_eager.register("gdn_closed_form_verify", cpu=_gdn_closed_form_verify_cpu, cuda=_gdn_closed_form_verify_cuda)

FOLDED_OP = "gdn_closed_form_folded_verify"


def _check_folded_structure(q, k, v, g, beta, state, state_indices, query_start_loc, out, ring_u, ring_k, ring_g,
                            pending_start, pending_count, max_window, max_pending) -> None:
    """The folded op's structure checks (no host sync), shared by its CPU and CUDA kernels."""
    _check_max_window(FOLDED_OP, max_window)
    check_gdn_window_structure(FOLDED_OP, q, k, v, g, beta, state, state_indices, query_start_loc, out)
    _check_ring_structure(FOLDED_OP, state, q, ring_u, ring_k, ring_g, pending_start, pending_count, max_window,
                          max_pending, state_indices.shape[0])


def _gdn_closed_form_folded_verify_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
    ring_u: torch.Tensor, ring_k: torch.Tensor, ring_g: torch.Tensor,
    pending_start: torch.Tensor, pending_count: torch.Tensor,
    max_window: int, max_pending: int, scale: float, use_qk_l2norm: bool,
) -> None:
    """``torch.ops.ssm_spec.gdn_closed_form_folded_verify`` (module docstring). CPU kernel; CUDA below."""
    _check_folded_structure(q, k, v, g, beta, state, state_indices, query_start_loc, out, ring_u, ring_k, ring_g,
                            pending_start, pending_count, max_window, max_pending)
    closed_form_cpu(q, k, v, g, beta, state, state_indices, query_start_loc, out, (ring_u, ring_k, ring_g),
                    max_window, scale, use_qk_l2norm, (pending_start, pending_count, max_pending))


gdn_closed_form_folded_verify_op = torch.library.custom_op(
    "ssm_spec::gdn_closed_form_folded_verify", mutates_args=("state", "out", "ring_u", "ring_k", "ring_g"))(
    _gdn_closed_form_folded_verify_cpu)


@gdn_closed_form_folded_verify_op.register_kernel("cuda")
def _gdn_closed_form_folded_verify_cuda(q, k, v, g, beta, state, state_indices, query_start_loc, out, ring_u,
                                        ring_k, ring_g, pending_start, pending_count, max_window, max_pending, scale,
                                        use_qk_l2norm):
    _check_folded_structure(q, k, v, g, beta, state, state_indices, query_start_loc, out, ring_u, ring_k, ring_g,
                            pending_start, pending_count, max_window, max_pending)
    launch_closed_form(q, k, v, g, beta, state, state_indices, query_start_loc, out, (ring_u, ring_k, ring_g),
                       max_window, scale, use_qk_l2norm, (pending_start, pending_count, max_pending))


@gdn_closed_form_folded_verify_op.register_fake
def _gdn_closed_form_folded_verify_fake(*args, **kwargs):
    return None


_eager.register(FOLDED_OP, cpu=_gdn_closed_form_folded_verify_cpu, cuda=_gdn_closed_form_folded_verify_cuda)


# ----------------------------------------------------------------------------- wrappers


class RecordRing(NamedTuple):
    """Per-slot replay records of the lazy commit (docs/design.md section 2.6), fp32.

    Attributes:
        u: ``[S, R, HV, V]`` corrections. k: ``[S, R, H, K]`` normalised keys.
        g: ``[S, R, HV]`` log decays (``exp`` of them is the record's decay).
    """

    u: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, positions: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
              head_v_dim: int, device=None) -> RecordRing:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros((num_slots, positions, num_v_heads, head_v_dim), **f32),
                   torch.zeros((num_slots, positions, num_k_heads, head_k_dim), **f32),
                   torch.zeros((num_slots, positions, num_v_heads), **f32))


def _resolve_max_window(op, max_window, windows):
    longest = max((e - b for b, e in windows), default=0) if windows is not None else None
    if max_window is None:
        if longest is None:
            fail(op, "max_window", None, "an int while compiling or capturing (the step's longest window)")
        return longest
    _check_max_window(op, max_window)
    if longest is not None and longest > max_window:
        fail(op, "max_window", max_window, f">= the longest window ({longest} tokens)")
    return max_window


def gdn_closed_form_verify(q, k, v, g, beta, state, state_indices, query_start_loc, max_window=None, scale=None,
                          use_qk_l2norm=True, validate=None):
    """Fast mode's verify: a window per row from a read-only checkpoint, in closed form.

    Same arguments, returns and errors as :func:`ssm_spec.ops.gdn_verify`, plus ``max_window``
    (int: the longest window of the call, a compile-time bound of the kernel; default: read
    from ``query_start_loc`` on the host, eager only). The record replays with
    :func:`~ssm_spec.ops.gdn_commit` as the exact one does. Outputs and records are within the
    fast mode's error bound of the token loop (docs/design.md section 2.6), not bit-identical.

    Raises:
        ValueError: what ``gdn_verify`` rejects; a window longer than ``max_window``; no
            ``max_window`` while compiling or capturing.
    """
    op = "gdn_closed_form_verify"
    do_validate, scale, out = prepare_window_call(op, q, k, v, g, beta, state, scale, use_qk_l2norm, validate)
    record = ReplayRecord.empty(q, v)
    windows = None
    if do_validate:
        check_gdn_window_structure(op, q, k, v, g, beta, state, state_indices, query_start_loc, out, *record)
        windows = window_bounds(op, query_start_loc, q.shape[0])
        slot_values(op, "state_indices", state_indices, state.shape[0])
    max_window = _resolve_max_window(op, max_window, windows)
    torch.ops.ssm_spec.gdn_closed_form_verify(q, k, v, g, beta, state, state_indices, query_start_loc, out,
                                              record.u, record.k, record.decay, max_window, scale, use_qk_l2norm)
    return out, record


def gdn_closed_form_folded_verify(q, k, v, g, beta, state, state_indices, query_start_loc, ring, pending_start,
                                  pending_count, max_pending, max_window=None, scale=None, use_qk_l2norm=True,
                                  validate=None):
    """Fast mode's folded verify with the lazy commit (module docstring).

    Args:
        q, k, v, g, beta, state_indices, query_start_loc, scale, use_qk_l2norm: as
            :func:`ssm_spec.ops.gdn_verify`.
        state: ``[S, HV, K, V]`` float32/bfloat16 pool, **mutated** by rows that fold.
        ring: :class:`RecordRing` ``[S, R, ...]``, ``R >= max(max_pending, max_window) +
            max_window`` (:func:`ring_positions`); the
            window's records are written at positions ``(pending_start + pending_count + t) % R``.
        pending_start, pending_count: ``[B]`` int32, row ``b``'s pending tokens (ring
            positions ``pending_start[b] + j``, ``j < pending_count[b]``, mod ``R``).
        max_pending: fold a row (replay its pending tokens, store its state once) when
            ``pending_count + W > max_pending``; 0 folds every pending row (a flush).
        max_window: as :func:`gdn_closed_form_verify`.

    Returns:
        ``out [T, HV, V]`` in ``v``'s dtype (tokens outside every window: uninitialised).

    Raises:
        ValueError: what ``gdn_verify`` rejects, plus ring shapes, dtypes or a ring shorter
            than :func:`ring_positions`, a count outside ``0..R - max_window``, two rows writing one
            slot, an expanded pool, a window longer than ``max_window``. Nothing is written.
    """
    op = FOLDED_OP
    do_validate, scale, out = prepare_window_call(op, q, k, v, g, beta, state, scale, use_qk_l2norm, validate)
    if not (isinstance(ring, tuple) and len(ring) == 3):
        fail(op, "ring", type(ring).__name__, "a RecordRing (u, k, g)")
    windows = None
    if do_validate:
        check_unaliased_pool(op, "state", state)
        check_gdn_window_structure(op, q, k, v, g, beta, state, state_indices, query_start_loc, out)
        windows = window_bounds(op, query_start_loc, q.shape[0])
    max_window = _resolve_max_window(op, max_window, windows)
    if do_validate:
        _check_ring_structure(op, state, q, *ring, pending_start, pending_count, max_window, max_pending,
                              state_indices.shape[0])
        slots = slot_values(op, "state_indices", state_indices, state.shape[0])
        R = ring[0].shape[1]
        for b, (p0, pn) in enumerate(zip(pending_start.tolist(), pending_count.tolist())):
            if not (0 <= pn <= R - max_window and 0 <= p0 < R):
                fail(op, f"pending_start[{b}] / pending_count[{b}]", f"{p0} / {pn}",
                     f"a start in 0..{R - 1} and a count in 0..{R - max_window} (the window's {max_window} "
                     f"records go after the pending ones, never over them)")
        check_write_conflicts(op, {}, [(b, s, f"state_indices[{b}]") for b, s in enumerate(slots) if s >= 0])
    torch.ops.ssm_spec.gdn_closed_form_folded_verify(q, k, v, g, beta, state, state_indices, query_start_loc, out,
                                                     *ring, pending_start, pending_count, max_window, max_pending,
                                                     scale, use_qk_l2norm)
    return out
