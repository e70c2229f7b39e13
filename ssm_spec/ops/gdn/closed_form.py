"""Fast mode (docs/design.md section 2.6): the closed-form window verify and its lazy folded form.

``gdn_closed_form_verify`` computes a window's outputs and replay record from a read-only
checkpoint without the token loop's dependent chain: the state is read once and contracted
against the window's stacked normalised keys and queries (``2W`` products over ``K``), and the
corrections solve the ``W x W`` unit lower-triangular system in registers
(:mod:`ssm_spec.reference_closed_form` is its float64 oracle). Its record is the exact verify's
(fp32 ``u``, ``k̂``, ``d = exp(g)``), so ``gdn_commit`` and the grouped commit replay it.

``gdn_closed_form_folded_verify`` is the lazy commit's verify. Each slot owns a ring of
``R = max(max_pending, max_window) + max_window`` record positions (``u``, ``k̂`` and the log decay ``g``) and
keeps its last ``p <= max(max_pending, W)`` accepted tokens there instead of in its state.
Per row: if ``p > 0`` and ``p + W > max_pending`` (the window's accepted tokens could pass
``max_pending``), the kernel first replays the ``p`` pending tokens onto the checkpoint with
the commit's update and stores the state once (the fold); otherwise it reads the state only and
adds the pending tokens' contribution in closed form. Either way it then solves the window and
appends the window's records right after the pending ones. ``max_pending = 1`` folds at every
step that has something pending: the folded commit of fast mode.

Not bit-identical to the token loop (other roundings; the contract is a bound on the error
against a float64 run, tested). Every sum has an order written in code: ``K`` reductions are
:func:`~ssm_spec.ops.gdn.inner.kdot`, and sums over window or history tokens are chains in
token order, so bits do not depend on the tile or the batch.
"""

from __future__ import annotations

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
from .inner import check_tile, gdn_tile_config, kdot, l2_normalize, next_power_of_2, use_ptx
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


@triton.jit(do_not_specialize=["T", "S", "R", "L"])
def gdn_closed_form_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, qsl_ptr, out_ptr,
    ru_ptr, rk_ptr, rg_ptr, pstart_ptr, pcount_ptr,
    scale, T, S, R, L,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_bt, s_bh,
    s_ss, s_sh, s_sk, s_sv, s_slot, s_qsl, s_ot, s_oh, s_ov,
    s_rus, s_rut, s_ruh, s_ruv, s_rks, s_rkt, s_rkh, s_rkk, s_rgs, s_rgt, s_rgh, s_ps, s_pc,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, WP: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, USE_PTX: tl.constexpr, RING: tl.constexpr,
):
    """One program per (V tile, row x value head): the state tile is read once into registers.

    ``RING=True`` (the lazy commit, module docstring): the row's ``p`` pending tokens are added
    to the tile in closed form, ``S_P = exp(G_P) S0 + sum_p exp(G_P - G_p) k̂_p u_p^T`` (decays
    as exp of differences, at most 1; one elementwise FMA pass per pending token, no
    reduction); a row that folds (``p > 0`` and ``p + W > L``) stores ``S_P`` once in the
    pool's dtype and continues from the stored value. Then, for either mode, every window token
    ``t``: its normalised key and query against the tile (:func:`~ssm_spec.ops.gdn.inner.kdot`,
    a fixed-order FMA chain), and against the earlier keys (the Gram rows); the ``W x W`` system
    on ``[WP, WP]`` register matrices, solved by rows in token order; ``U = T R`` and the
    outputs as rank-1 updates in token order. Every sum has an order of the code's, so the bits
    do not depend on the tile. The window (at most ``WP`` tokens; validation rejects longer
    ones, the kernel cuts them) has zero padding rows (zero key, query and beta), which reach
    no valid output.

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
        m_k = o_k < K
        m_v = o_v < V
        m_w = o_w < W
        m_h = m_k[:, None] & m_v[None, :]
        tok = bos.to(tl.int64) + o_w  # int64 token offsets
        tile = state_ptr + slot * s_ss + i_hv * s_sh + o_k[:, None] * s_sk + o_v[None, :] * s_sv
        b_h = tl.load(tile, mask=m_h, other=0).to(tl.float32)
        wpos = 0
        if RING:
            p0 = tl.minimum(tl.maximum(tl.load(pstart_ptr + i_b * s_ps), 0), R - 1)
            pn = tl.minimum(tl.maximum(tl.load(pcount_ptr + i_b * s_pc), 0), R)
            wpos = (p0 + pn) % R
            if pn > 0:
                GP = tl.load(rg_ptr + slot * s_rgs + p0 * s_rgt + i_hv * s_rgh)
                j = 1
                while j < pn:  # G_P, summed in history order
                    GP += tl.load(rg_ptr + slot * s_rgs + ((p0 + j) % R) * s_rgt + i_hv * s_rgh)
                    j += 1
                b_h = b_h * tl.exp(GP)
                Gj = GP * 0.0
                j = 0
                while j < pn:
                    pos = (p0 + j) % R
                    Gj += tl.load(rg_ptr + slot * s_rgs + pos * s_rgt + i_hv * s_rgh)
                    b_kp = tl.load(rk_ptr + slot * s_rks + pos * s_rkt + i_h * s_rkh + o_k * s_rkk, mask=m_k, other=0)
                    b_up = tl.load(ru_ptr + slot * s_rus + pos * s_rut + i_hv * s_ruh + o_v * s_ruv, mask=m_v,
                                   other=0)
                    b_h = tl.fma((b_kp * tl.exp(GP - Gj))[:, None], b_up[None, :], b_h)
                    j += 1
                if pn + W > L:  # the fold: S_P stored once; the window continues from the stored value
                    b_hs = b_h.to(state_ptr.dtype.element_ty)
                    tl.store(tile, b_hs, mask=m_h)
                    b_h = b_hs.to(tl.float32)
        # ---- per window token: k̂, q̂ against the tile and the earlier keys
        KS = tl.zeros([WP, BV], dtype=tl.float32)
        QS = tl.zeros([WP, BV], dtype=tl.float32)
        KmT = tl.zeros([BK, WP], dtype=tl.float32)  # column t: k̂_t
        KK = tl.zeros([WP, WP], dtype=tl.float32)  # row t: k̂_t . k̂_j
        QK = tl.zeros([WP, WP], dtype=tl.float32)  # row t: q̂_t . k̂_j
        o_r = o_w[:, None]
        write_k = (i_v == 0) & (i_hv % (HV // H) == 0)
        for t in tl.static_range(WP):
            l_k = m_k & (o_k * 0 + bos + t < eos)
            b_k = tl.load(k_ptr + (bos + t) * s_kt + i_h * s_kh + o_k * s_kk, mask=l_k, other=0).to(tl.float32)
            b_q = tl.load(q_ptr + (bos + t) * s_qt + i_h * s_qh + o_k * s_qk, mask=l_k, other=0).to(tl.float32)
            if USE_QK_L2NORM:
                b_k = l2_normalize(b_k, USE_PTX)
                b_q = l2_normalize(b_q, USE_PTX) * scale
            else:
                b_q = b_q * scale
            KmT = tl.where(o_w[None, :] == t, b_k[:, None], KmT)
            KK = tl.where(o_r == t, kdot(KmT, b_k, USE_PTX)[None, :], KK)
            QK = tl.where(o_r == t, kdot(KmT, b_q, USE_PTX)[None, :], QK)
            KS = tl.where(o_r == t, kdot(b_h, b_k, USE_PTX)[None, :], KS)
            QS = tl.where(o_r == t, kdot(b_h, b_q, USE_PTX)[None, :], QS)
            if write_k & (bos + t < eos):  # the record's k̂
                if RING:
                    tl.store(rk_ptr + slot * s_rks + ((wpos + t) % R) * s_rkt + i_h * s_rkh + o_k * s_rkk, b_k,
                             mask=m_k)
                else:
                    tl.store(rk_ptr + (bos + t) * s_rkt + i_h * s_rkh + o_k * s_rkk, b_k, mask=m_k)
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
        Rm = b_beta[:, None] * (b_v - eG[:, None] * KS)
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


def window_block(max_window: int) -> int:
    """The kernel's window block ``WP = next_pow2(max(1, max_window))`` (a constexpr: one
    binary per power of two)."""
    return next_power_of_2(max(1, int(max_window)))


def ring_positions(max_pending: int, max_window: int) -> int:
    """Ring positions a slot needs: ``max(max_pending, max_window) + max_window`` (at least 1).

    A row's pending tokens never pass ``max(max_pending, W)`` (a row under the bound keeps at
    most ``max_pending``; a row that folds keeps only its new accepted tokens), and the window's
    records go right after them, never over a pending record another program may still read."""
    return max(1, max(max_pending, max_window) + max_window)


def launch_closed_form(q, k, v, g, beta, state, slots, query_start_loc, out, record, max_window, scale,
                       use_qk_l2norm, pending=None, config=None):
    """Launch :func:`gdn_closed_form_kernel` (no allocation).

    ``record`` is ``(u, k, third)``: token rows ``[T, ...]`` with ``third = decay`` when
    ``pending`` is None, else the ring ``[S, R, ...]`` with ``third = g``; ``pending`` is
    ``(pending_start [B], pending_count [B], max_pending)``. ``config`` overrides the tile
    ``(BK, BV, num_warps)`` (bits do not depend on it).
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = slots.shape[0]
    BK, BV, num_warps = (check_tile(config, K) if config is not None
                         else gdn_tile_config(K, V, "closed_form", state.dtype, B))
    if B == 0:
        return
    ru, rk, rg = record
    if pending is None:
        pstart = pcount = slots
        R, L = 1, 0
        rec_strides = (0, *ru.stride(), 0, *rk.stride(), 0, *rg.stride())
    else:
        pstart, pcount, L = pending
        R = ru.shape[1]
        rec_strides = (*ru.stride(), *rk.stride(), *rg.stride())
    grid = (triton.cdiv(V, BV), B * HV)
    gdn_closed_form_kernel[grid](
        q, k, v, g, beta, state, slots, query_start_loc, out, ru, rk, rg, pstart, pcount,
        float(scale), T, state.shape[0], R, int(L),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        *state.stride(), slots.stride(0), query_start_loc.stride(0), *out.stride(),
        *rec_strides, pstart.stride(0), pcount.stride(0),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, WP=window_block(max_window), USE_QK_L2NORM=bool(use_qk_l2norm),
        USE_PTX=use_ptx(), RING=pending is not None, num_warps=num_warps,
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
            p0, pn = min(max(starts[b], 0), R - 1), min(max(counts[b], 0), R)
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
