"""The window kernel verify, the native snapshot and the folded verify share.

:func:`gdn_window_kernel` (Triton), its launcher :func:`launch_gdn_window`, its CPU twin
:func:`gdn_window_cpu` and the structure checks and preamble of the ops built on it
(``verify.py``, ``snapshot.py``, ``folded.py``, and the closed-form ops' checks). One kernel
body, each op a constexpr mode of it, so the three compute the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import reference
from .._launch import strides
from .._validate import (
    FLOAT_DTYPES,
    STATE_DTYPES,
    check_dims,
    check_index,
    check_no_grad,
    check_scalars,
    check_tensor,
    should_validate,
)
from .._window import clamped_window, load_window
from .inner import (
    gdn_apply,
    gdn_correction,
    gdn_decay,
    kdot,
    l2_normalize,
    load_record_token,
    pin,
    replay_token,
    use_ptx,
)
from .tiles import check_tile, gdn_tile_config

# ----------------------------------------------------------------------------- Triton


@triton.jit
def load_window_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, end, i_h, i_hv, o_k, o_v, m_k, m_v,
                      s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_bt, s_bh):
    """Token ``t``'s ``q [BK], k [BK], v [BV], g, beta`` in fp32; zeros unless ``t < end`` (the
    prefetch past a window's last token reads nothing). The vector masks compare per lane:
    Triton 3.6's interpreter rejects a vector mask combined with a scalar one."""
    l_k = m_k & (o_k * 0 + t < end)
    l_v = m_v & (o_v * 0 + t < end)
    b_q = tl.load(q_ptr + t * s_qt + i_h * s_qh + o_k * s_qk, mask=l_k, other=0).to(tl.float32)
    b_k = tl.load(k_ptr + t * s_kt + i_h * s_kh + o_k * s_kk, mask=l_k, other=0).to(tl.float32)
    b_v = tl.load(v_ptr + t * s_vt + i_hv * s_vh + o_v * s_vv, mask=l_v, other=0).to(tl.float32)
    b_g = tl.load(g_ptr + t * s_gt + i_hv * s_gh, mask=t < end, other=0).to(tl.float32)
    b_beta = tl.load(beta_ptr + t * s_bt + i_hv * s_bh, mask=t < end, other=0).to(tl.float32)
    return b_q, b_k, b_v, b_g, b_beta


@triton.jit(do_not_specialize=["S", "TP",
                               # the fold's inputs are dummies when it is off: never specialized
                               # on them
                               "pru_ptr", "prk_ptr", "prd_ptr", "pstart_ptr", "pn_ptr",
                               "s_prut", "s_pruh", "s_pruv", "s_prkt", "s_prkh", "s_prkk",
                               "s_prdt", "s_prdh", "s_pstart", "s_pn"])
def gdn_window_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    state_ptr, src_ptr, qsl_ptr, snap_ptr,
    out_ptr, ru_ptr, rk_ptr, rd_ptr,
    pru_ptr, prk_ptr, prd_ptr, pstart_ptr, pn_ptr,
    scale, T, S, TP,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_bt, s_bh,
    s_ss, s_sh, s_sk, s_sv, s_src, s_qsl, s_snap,
    s_ot, s_oh, s_ov, s_rut, s_ruh, s_ruv, s_rkt, s_rkh, s_rkk, s_rdt, s_rdh,
    s_prut, s_pruh, s_pruv, s_prkt, s_prkh, s_prkk, s_prdt, s_prdh, s_pstart, s_pn,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_PTX: tl.constexpr,
    STORE_RECORD: tl.constexpr, STORE_SNAPSHOTS: tl.constexpr, FOLD: tl.constexpr,
):
    """One program per (V tile, row x value head): the state tile stays in registers across
    the row's window. ``STORE_RECORD``: write the replay record (verify). ``STORE_SNAPSHOTS``:
    write the state after each token into ``snap_ptr[t]`` (the native path). ``FOLD``: first
    replay the row's previous window, ``pn[b]`` tokens of the previous step's records from
    token ``pstart[b]`` (``TP`` rows), onto the checkpoint, store it once in the pool's dtype
    and verify from that stored value (the folded commit).

    The modes are constexprs: each compiles its own binary (verify carries no snapshot or
    fold code, and its registers), and the binaries agree bit for bit because every reduction
    is :func:`~ssm_spec.ops.gdn.inner.kdot`, whose order is the code's, not the layout's. The
    fold replays records with the commit's update (:func:`~ssm_spec.ops.gdn.inner.replay_token`),
    so it lands on the commit's bits."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(src_ptr + i_b * s_src).to(tl.int64)
    bos, eos = load_window(qsl_ptr, i_b, s_qsl, T)
    if (slot >= 0) & (slot < S):
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_k[:, None] & m_v[None, :]
        tile = i_hv * s_sh + o_k[:, None] * s_sk + o_v[None, :] * s_sv
        t = bos.to(tl.int64)  # int64 token offsets
        # Software pipelining by hand: the inputs of token t + 1 are loaded while token t is
        # computed, the first token's with the state tile (a while loop over loaded bounds is
        # not pipelined by Triton, and Triton 3.6's interpreter cannot range() over them).
        n_q, n_k, n_v, n_g, n_beta = load_window_token(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, eos, i_h, i_hv, o_k, o_v, m_k, m_v,
            s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_bt, s_bh)
        b_h = tl.load(state_ptr + slot * s_ss + tile, mask=m_h, other=0).to(tl.float32)
        if FOLD:
            p0 = tl.minimum(tl.maximum(tl.load(pstart_ptr + i_b * s_pstart), 0), TP)
            pn = tl.minimum(tl.maximum(tl.load(pn_ptr + i_b * s_pn), 0), TP - p0)
            tok = p0.to(tl.int64)
            n_kp, n_up, n_dp = load_record_token(pru_ptr, prk_ptr, prd_ptr, tok, p0 + pn, i_h, i_hv,
                                                 o_k, o_v, m_k, m_v, s_prut, s_pruh, s_pruv, s_prkt, s_prkh,
                                                 s_prkk, s_prdt, s_prdh)
            while tok < p0 + pn:  # the next record loads while this one is applied (as commit)
                b_kp, b_up, b_dp = n_kp, n_up, n_dp
                n_kp, n_up, n_dp = load_record_token(pru_ptr, prk_ptr, prd_ptr, tok + 1, p0 + pn, i_h,
                                                     i_hv, o_k, o_v, m_k, m_v, s_prut, s_pruh, s_pruv, s_prkt,
                                                     s_prkh, s_prkk, s_prdt, s_prdh)
                b_h = replay_token(b_h, b_kp, b_up, b_dp, USE_PTX)
                tok += 1
            if pn > 0:  # the committed state, stored once; verify continues from the stored value
                b_hs = b_h.to(state_ptr.dtype.element_ty)
                tl.store(state_ptr + slot * s_ss + tile, b_hs, mask=m_h)
                b_h = b_hs.to(tl.float32)
        write_k = (i_v == 0) & (i_hv % (HV // H) == 0)
        while t < eos:
            b_q, b_k, b_v, b_g, b_beta = n_q, n_k, n_v, n_g, n_beta
            n_q, n_k, n_v, n_g, n_beta = load_window_token(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t + 1, eos, i_h, i_hv, o_k, o_v, m_k, m_v,
                s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_bt, s_bh)
            if USE_QK_L2NORM:
                b_k = l2_normalize(b_k, USE_PTX)
                b_q = l2_normalize(b_q, USE_PTX) * scale
            else:
                b_q = b_q * scale
            b_d = tl.exp(b_g)
            b_p = gdn_decay(b_h, b_d, USE_PTX)
            b_u = pin(gdn_correction(b_p, b_k, b_v, b_beta, USE_PTX), USE_PTX)
            b_h = gdn_apply(b_p, tl.broadcast_to(b_k[:, None], (BK, BV)), b_u, USE_PTX)
            b_o = kdot(b_h, b_q, USE_PTX)
            tl.store(out_ptr + t * s_ot + i_hv * s_oh + o_v * s_ov,
                     b_o.to(out_ptr.dtype.element_ty), mask=m_v)
            if STORE_RECORD:
                tl.store(ru_ptr + t * s_rut + i_hv * s_ruh + o_v * s_ruv, b_u, mask=m_v)
                if i_v == 0:
                    tl.store(rd_ptr + t * s_rdt + i_hv * s_rdh, b_d)
                if write_k:
                    tl.store(rk_ptr + t * s_rkt + i_h * s_rkh + o_k * s_rkk, b_k, mask=m_k)
            if STORE_SNAPSHOTS:
                snap = tl.load(snap_ptr + t * s_snap).to(tl.int64)
                if (snap >= 0) & (snap < S):
                    tl.store(state_ptr + snap * s_ss + tile,
                             b_h.to(state_ptr.dtype.element_ty), mask=m_h)
            t += 1


def launch_gdn_window(q, k, v, g, beta, state, src_indices, query_start_loc, snapshot_indices,
                      out, record, scale, use_qk_l2norm, config=None, fold=None):
    """Launch :func:`gdn_window_kernel` (no allocation; the grid depends on shapes only).

    ``record`` is ``(rec_u, rec_k, rec_decay)`` or None; ``snapshot_indices`` a ``[T]`` index
    tensor or None; ``fold`` is ``(prev_rec_u, prev_rec_k, prev_rec_decay, prev_start,
    prev_num_accepted_tokens)`` or None. ``config`` overrides the tile ``(BK, BV, num_warps)``
    of :func:`gdn_tile_config` (benchmarks and tuning; bits do not depend on it;
    ``ValueError`` for a tile the kernel cannot run, see :func:`check_tile`).
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = src_indices.shape[0]
    kernel = "snapshot" if snapshot_indices is not None else "verify"
    BK, BV, num_warps = (check_tile(config, K) if config is not None
                         else gdn_tile_config(K, V, kernel, state.dtype, B))
    if B == 0:
        return
    # Unused buffers get dummies shaped like the real ones (an fp32/int32 pointer and the
    # strides of contiguous records / indices); the modes themselves are constexprs.
    if record is not None:
        ru, rk, rd = record
        rec_strides = {**strides(ru, "s_rut", "s_ruh", "s_ruv"), **strides(rk, "s_rkt", "s_rkh", "s_rkk"),
                       **strides(rd, "s_rdt", "s_rdh")}
    else:
        ru = rk = rd = g  # an fp32 pointer; never written without STORE_RECORD
        rec_strides = dict(s_rut=HV * V, s_ruh=V, s_ruv=1, s_rkt=H * K, s_rkh=K, s_rkk=1, s_rdt=HV, s_rdh=1)
    if snapshot_indices is not None:
        snap, snap_stride = snapshot_indices, snapshot_indices.stride(0)
    else:
        snap, snap_stride = src_indices, 1
    if fold is not None:
        pru, prk, prd, pstart, pn = fold
        TP = pru.shape[0]
        fold_strides = {**strides(pru, "s_prut", "s_pruh", "s_pruv"), **strides(prk, "s_prkt", "s_prkh", "s_prkk"),
                        **strides(prd, "s_prdt", "s_prdh"), "s_pstart": pstart.stride(0), "s_pn": pn.stride(0)}
    else:  # dummies of the same kinds as the real ones (never read without FOLD)
        pru, prk, prd, pstart, pn, TP = ru, rk, rd, src_indices, src_indices, 0
        fold_strides = dict(s_prut=HV * V, s_pruh=V, s_pruv=1, s_prkt=H * K, s_prkh=K, s_prkk=1, s_prdt=HV,
                            s_prdh=1, s_pstart=1, s_pn=1)
    grid = (triton.cdiv(V, BV), B * HV)
    gdn_window_kernel[grid](
        q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=g, beta_ptr=beta,
        state_ptr=state, src_ptr=src_indices, qsl_ptr=query_start_loc, snap_ptr=snap,
        out_ptr=out, ru_ptr=ru, rk_ptr=rk, rd_ptr=rd,
        pru_ptr=pru, prk_ptr=prk, prd_ptr=prd, pstart_ptr=pstart, pn_ptr=pn,
        scale=float(scale), T=T, S=state.shape[0], TP=TP,
        **window_strides(q, k, v, g, beta, state, out), s_src=src_indices.stride(0),
        s_qsl=query_start_loc.stride(0), s_snap=snap_stride, **rec_strides, **fold_strides,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_QK_L2NORM=bool(use_qk_l2norm),
        USE_PTX=use_ptx(), STORE_RECORD=record is not None, STORE_SNAPSHOTS=snapshot_indices is not None,
        FOLD=fold is not None, num_warps=num_warps,
    )


def window_strides(q, k, v, g, beta, state, out) -> dict[str, int]:
    """The stride arguments of a window's inputs, the state pool and the outputs, by the names
    :func:`gdn_window_kernel` and the closed-form kernel both give them."""
    return {**strides(q, "s_qt", "s_qh", "s_qk"), **strides(k, "s_kt", "s_kh", "s_kk"),
            **strides(v, "s_vt", "s_vh", "s_vv"), **strides(g, "s_gt", "s_gh"), **strides(beta, "s_bt", "s_bh"),
            **strides(state, "s_ss", "s_sh", "s_sk", "s_sv"), **strides(out, "s_ot", "s_oh", "s_ov")}


# ----------------------------------------------------------------------------- CPU


def gdn_window_cpu(q, k, v, g, beta, state, src_indices, query_start_loc, snapshot_indices,
                   out, record, scale, use_qk_l2norm, fold=None):
    """CPU twin of :func:`gdn_window_kernel`: the reference's own per-token expressions,
    row by row; clamps windows and skips out-of-range slots exactly like the kernel. Arguments
    as :func:`launch_gdn_window`'s; a ``fold`` is replayed first (:func:`gdn_fold_cpu`)."""
    if fold is not None:
        prev_rec_u, prev_rec_k, prev_rec_decay, prev_start, prev_num_accepted_tokens = fold
        gdn_fold_cpu(state, prev_rec_u, prev_rec_k, prev_rec_decay, src_indices, prev_start,
                     prev_num_accepted_tokens)
    T, S = q.shape[0], state.shape[0]
    qsl = query_start_loc.tolist()
    snaps = snapshot_indices.tolist() if snapshot_indices is not None else None
    rows = []
    for b, slot in enumerate(src_indices.tolist()):
        bos, eos = clamped_window(qsl, b, T)
        if 0 <= slot < S and eos > bos:
            rows.append((slot, bos, eos))
    if snaps is None:  # rows of one window length at once (bit for bit what each gets alone)
        rows = _window_rows_batched(rows, q, k, v, g, beta, state, out, record, scale, use_qk_l2norm)
    for slot, bos, eos in rows:
        res = reference.gdn_native_step(
            q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], state[slot],
            scale=scale, use_qk_l2norm=use_qk_l2norm, dtype=torch.float32,
        )
        out[bos:eos] = res.out
        if record is not None:
            record[0][bos:eos] = res.u
            record[1][bos:eos] = res.khat
            record[2][bos:eos] = res.decay
        if snaps is not None:
            for t in range(bos, eos):
                if 0 <= snaps[t] < S:
                    state[snaps[t]] = res.states[t - bos]


def _window_rows_batched(rows, q, k, v, g, beta, state, out, record, scale, use_qk_l2norm):
    """:func:`gdn_window_cpu`'s rows in groups of one window length, each group one token loop
    (:func:`reference.gdn_native_step_rows`); returns the rows left alone in their group."""
    groups: dict[int, list] = {}
    for row in rows:
        groups.setdefault(row[2] - row[1], []).append(row)
    rest = []
    for length, group in groups.items():
        if len(group) == 1:
            rest.extend(group)
            continue
        idx = torch.stack([torch.arange(bos, eos, device=q.device) for _, bos, eos in group])  # [R, L]
        init = state[torch.tensor([slot for slot, _, _ in group], device=state.device)]
        res = reference.gdn_native_step_rows(q[idx], k[idx], v[idx], g[idx], beta[idx], init, scale=scale,
                                             use_qk_l2norm=use_qk_l2norm, dtype=torch.float32)
        flat = idx.reshape(-1)
        out[flat] = res.out.reshape(-1, *res.out.shape[2:]).to(out.dtype)
        if record is not None:
            record[0][flat] = res.u.reshape(-1, *res.u.shape[2:])
            record[1][flat] = res.khat.reshape(-1, *res.khat.shape[2:])
            record[2][flat] = res.decay.reshape(-1, *res.decay.shape[2:])
    return rest


def gdn_fold_cpu(state, prev_rec_u, prev_rec_k, prev_rec_decay, src_indices, prev_start, prev_num_accepted_tokens):
    """CPU twin of the kernel's fold: replay ``prev_n[b]`` tokens from ``prev_start[b]`` onto
    ``state[src[b]]`` (:func:`reference.gdn_replay_update`, the commit's update) and store it;
    counts and starts clamped into the record buffer, out-of-range slots skipped."""
    S, HV = state.shape[:2]
    TP = prev_rec_u.shape[0]
    group = HV // prev_rec_k.shape[1]
    for b, (slot, p0, pn) in enumerate(zip(src_indices.tolist(), prev_start.tolist(),
                                           prev_num_accepted_tokens.tolist())):
        p0 = min(max(p0, 0), TP)
        pn = min(max(pn, 0), TP - p0)
        if not 0 <= slot < S or pn == 0:
            continue
        h = state[slot].to(torch.float32).clone()
        for tok in range(p0, p0 + pn):
            h = reference.gdn_replay_update(h, prev_rec_k[tok].repeat_interleave(group, 0), prev_rec_u[tok],
                                            prev_rec_decay[tok])
        state[slot] = h


# ----------------------------------------------------------------------------- checks


def prepare_window_call(op, q, k, v, g, beta, state, scale, use_qk_l2norm, validate):
    """The two window wrappers' shared preamble: resolve ``validate``; when on, check what is
    read before allocating (ranks of q and v, non-empty head dims, static arguments, no
    autograd); resolve ``scale``; allocate ``out [T, HV, V]``. Returns
    ``(do_validate, scale, out)``."""
    do_validate = should_validate(validate, op)
    if do_validate:
        check_tensor(op, "q", q, ndim=3)
        check_tensor(op, "v", v, ndim=3)
        if q.shape[-1] == 0 or v.shape[-1] == 0:
            raise ValueError(f"{op}: q, v: got head dims K={q.shape[-1]}, V={v.shape[-1]}; expected >= 1")
        check_scalars(op, scale=scale, use_qk_l2norm=use_qk_l2norm)
        check_no_grad(op, q=q, k=k, v=v, g=g, beta=beta, state=state)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out = torch.empty((q.shape[0], *v.shape[-2:]), dtype=v.dtype, device=v.device)
    return do_validate, scale, out


def check_gdn_window_structure(op, q, k, v, g, beta, state, src_indices, query_start_loc, out,
                               rec_u=None, rec_k=None, rec_decay=None, *, indices="state_indices",
                               rec="rec_"):
    """Ranks, shapes, dtypes, devices of the window ops' arguments (no host sync).

    Each size is taken from every argument that carries it, and the one that disagrees with
    the others is named (a state of another layer is named ``state``, not ``q``).
    ``indices``: the name of the slot argument; ``rec``: the prefix of the record's names
    (``rec_u``, ... for the op; ``record.`` for a wrapper given ``record``).
    """
    check_tensor(op, "state", state, ndim=4, dtypes=STATE_DTYPES)
    dev = state.device
    if min(state.shape[1:]) == 0:
        raise ValueError(f"{op}: state: got shape {list(state.shape)}; expected HV, K, V >= 1")
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(op, "k", k, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(op, "v", v, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(op, "g", g, ndim=2, dtypes=(torch.float32,), device=dev)
    check_tensor(op, "beta", beta, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    shapes = dict(q=q.shape, k=k.shape, v=v.shape, g=g.shape, beta=beta.shape, state=state.shape)

    def dims(name, *where):
        return check_dims(op, name, {arg: (shapes[arg][i], shapes[arg]) for arg, i in where})

    T = dims("T", ("q", 0), ("k", 0), ("v", 0), ("g", 0), ("beta", 0))
    H = dims("H", ("q", 1), ("k", 1))
    K = dims("K", ("q", 2), ("k", 2), ("state", 2))
    HV = dims("HV", ("v", 1), ("g", 1), ("beta", 1), ("state", 1))
    V = dims("V", ("v", 2), ("state", 3))
    if H == 0 or HV % H != 0:
        raise ValueError(f"{op}: q: got {H} key heads for {HV} value heads (v, state); expected HV % H == 0")
    check_index(op, "query_start_loc", query_start_loc, None, dev)
    B = query_start_loc.shape[0] - 1
    if B < 0:
        raise ValueError(f"{op}: query_start_loc: got an empty tensor; expected [B + 1] entries")
    check_index(op, indices, src_indices, B, dev)
    check_tensor(op, "out", out, shape=(None, HV, V), dtypes=(v.dtype,), device=dev)
    if out.shape[0] < T:
        raise ValueError(f"{op}: out: got {out.shape[0]} token rows; expected at least {T}")
    if rec_u is not None:
        check_tensor(op, f"{rec}u", rec_u, shape=(out.shape[0], HV, V), dtypes=(torch.float32,), device=dev)
        check_tensor(op, f"{rec}k", rec_k, shape=(out.shape[0], H, K), dtypes=(torch.float32,), device=dev)
        check_tensor(op, f"{rec}decay", rec_decay, shape=(out.shape[0], HV), dtypes=(torch.float32,), device=dev)
