"""The closed-form verify kernel (Triton), its launcher and its CPU twin.

:func:`gdn_closed_form_kernel` serves both closed-form ops (the plain verify and the lazy
commit's folded verify, its ``RING`` mode); the package docstring states the algorithm and its
ordering contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .... import reference, reference_closed_form
from ..._launch import strides
from ..._window import clamped_window, load_window
from ..inner import kdot, use_ptx
from ..tiles import check_tile, gdn_tile_config
from ..window import window_strides
from .blocks import _at, _col, _cols, _fold_block, _load_u, _or_neg_zero, _ring_pos, _row, _window_keys, chain_rows
from .config import MAX_REGISTERS, _check_int, block_constants, window_block

# ----------------------------------------------------------------------------- Triton


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

    ``RING=True`` (the lazy commit, package docstring): a row that folds (``p > 0`` and
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
    if pending is None:  # token rows: no slot dim (stride 0)
        pstart = pcount = slots
        R, L = 1, 0
        rec_strides = {"s_rus": 0, **strides(ru, "s_rut", "s_ruh", "s_ruv"), "s_rks": 0,
                       **strides(rk, "s_rkt", "s_rkh", "s_rkk"), "s_rgs": 0, **strides(rg, "s_rgt", "s_rgh")}
    else:
        pstart, pcount, L = pending
        R = ru.shape[1]
        rec_strides = {**strides(ru, "s_rus", "s_rut", "s_ruh", "s_ruv"),
                       **strides(rk, "s_rks", "s_rkt", "s_rkh", "s_rkk"), **strides(rg, "s_rgs", "s_rgt", "s_rgh")}
    blocks = block_constants(BK, max_window, R, pending is not None, key_rows, stages, prefetch)  # checks them
    if B == 0:
        return
    grid = (triton.cdiv(V, BV), B * HV)
    gdn_closed_form_kernel[grid](
        q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=g, beta_ptr=beta, state_ptr=state, slot_ptr=slots, qsl_ptr=query_start_loc,
        out_ptr=out, ru_ptr=ru, rk_ptr=rk, rg_ptr=rg, pstart_ptr=pstart, pcount_ptr=pcount,
        scale=float(scale), T=T, S=state.shape[0], R=R, L=int(L), PMAX=max(0, R - int(max_window)),
        **window_strides(q, k, v, g, beta, state, out), s_slot=slots.stride(0), s_qsl=query_start_loc.stride(0),
        **rec_strides, s_ps=pstart.stride(0), s_pc=pcount.stride(0),
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
