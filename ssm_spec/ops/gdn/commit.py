"""``gdn_commit``: replay the accepted tokens of a verify window and write the state once.

Kernel (Triton, CUDA), launcher, CPU implementation, registration and wrapper. The grouped
form (state ``[NL, S, HV, K, V]``, records ``[NL, T, ...]``) commits every layer in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import reference
from .. import _layout
from .._launch import commit_metadata_strides, strides
from .._library import define_op
from .._validate import (
    STATE_DTYPES,
    check_commit_metadata,
    check_commit_values,
    check_dims,
    check_no_grad,
    check_tensor,
    check_unaliased_pool,
    commit_defaults,
    fail,
    should_validate,
)
from .._window import clamped_count, clamped_window, load_count, load_window
from .inner import load_record_token, replay_token, use_ptx
from .tiles import check_tile, gdn_tile_config

# ----------------------------------------------------------------------------- Triton


@triton.jit
def store_boundaries(layer, b_h, done, i_b, tile, m_h, S, NBD, bidx_ptr, boff_ptr, s_ss, s_bib, s_bij, s_bob,
                     s_boj):
    """Store the state after ``done`` accepted tokens into every boundary entry of row ``i_b``
    whose offset is ``done`` and whose index is a slot (``0 <= idx < S``)."""
    j = 0
    while j < NBD:
        off = tl.load(boff_ptr + i_b * s_bob + j * s_boj)
        bidx = tl.load(bidx_ptr + i_b * s_bib + j * s_bij).to(tl.int64)
        if (off == done) & (bidx >= 0) & (bidx < S):
            tl.store(layer + bidx * s_ss + tile, b_h.to(layer.dtype.element_ty), mask=m_h)
        j += 1


@triton.jit
def gdn_commit_kernel(
    state_ptr, ru_ptr, rk_ptr, rd_ptr, qsl_ptr, src_ptr, n_ptr, dst_ptr, bidx_ptr, boff_ptr,
    T, S, NBD,
    s_sl, s_ss, s_sh, s_sk, s_sv,
    s_rul, s_rut, s_ruh, s_ruv, s_rkl, s_rkt, s_rkh, s_rkk, s_rdl, s_rdt, s_rdh,
    s_qsl, s_src, s_n, s_dst, s_bib, s_bij, s_bob, s_boj,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_PTX: tl.constexpr,
):
    """One program per (V tile, row x value head, layer). Reads its whole source tile, replays
    ``n`` recorded tokens, writes boundary states as their offsets pass and the destination
    last. Counts are clamped to the window, out-of-range slots skipped."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_l = tl.program_id(2).to(tl.int64)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    bos, eos = load_window(qsl_ptr, i_b, s_qsl, T)
    n = load_count(n_ptr, i_b, s_n, eos - bos)
    src = tl.load(src_ptr + i_b * s_src).to(tl.int64)
    if (n > 0) & (src >= 0) & (src < S):
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_k[:, None] & m_v[None, :]
        layer = state_ptr + i_l * s_sl
        tile = i_hv * s_sh + o_k[:, None] * s_sk + o_v[None, :] * s_sv
        ru_l, rk_l, rd_l = ru_ptr + i_l * s_rul, rk_ptr + i_l * s_rkl, rd_ptr + i_l * s_rdl
        # the first record loads beside the state tile, and each next one while this one is
        # applied (a while loop: Triton 3.6's interpreter cannot range() over loaded bounds,
        # and Triton does not pipeline it). Loading four records at once was measured slower
        # on the H200 (docs/perf-notes.md).
        n_k, n_u, n_d = load_record_token(ru_l, rk_l, rd_l, bos.to(tl.int64), bos + n, i_h, i_hv, o_k, o_v, m_k, m_v,
                                          s_rut, s_ruh, s_ruv, s_rkt, s_rkh, s_rkk, s_rdt, s_rdh)
        b_h = tl.load(layer + src * s_ss + tile, mask=m_h, other=0).to(tl.float32)
        t = 0
        while t < n:
            b_k, b_u, b_d = n_k, n_u, n_d
            n_k, n_u, n_d = load_record_token(ru_l, rk_l, rd_l, (bos + t + 1).to(tl.int64), bos + n, i_h, i_hv,
                                              o_k, o_v, m_k, m_v, s_rut, s_ruh, s_ruv, s_rkt, s_rkh, s_rkk,
                                              s_rdt, s_rdh)
            b_h = replay_token(b_h, b_k, b_u, b_d, USE_PTX)
            store_boundaries(layer, b_h, t + 1, i_b, tile, m_h, S, NBD, bidx_ptr, boff_ptr, s_ss, s_bib, s_bij,
                             s_bob, s_boj)
            t += 1
        dst = tl.load(dst_ptr + i_b * s_dst).to(tl.int64)
        if (dst >= 0) & (dst < S):
            tl.store(layer + dst * s_ss + tile, b_h.to(state_ptr.dtype.element_ty), mask=m_h)


def _grouped(state, rec_u, rec_k, rec_decay):
    """View the per-layer form as a group of one layer (views only, no copies)."""
    if state.dim() == 4:
        return state.unsqueeze(0), rec_u.unsqueeze(0), rec_k.unsqueeze(0), rec_decay.unsqueeze(0)
    return state, rec_u, rec_k, rec_decay


def launch_gdn_commit(state, rec_u, rec_k, rec_decay, query_start_loc, src_indices,
                      num_accepted_tokens, dst_indices, boundary_indices, boundary_offsets,
                      config=None):
    """Launch :func:`gdn_commit_kernel` over every layer of the (grouped) state in one grid.

    ``config`` overrides commit's tile ``(BK, BV, num_warps)`` (benchmarks and tuning; any
    tile gives the same bits; ``ValueError`` for one the kernel cannot run, see
    :func:`check_tile`)."""
    state, rec_u, rec_k, rec_decay = _grouped(state, rec_u, rec_k, rec_decay)
    NL, S, HV, K, V = state.shape
    H = rec_k.shape[2]
    T = rec_u.shape[1]
    B = src_indices.shape[0]
    NBD = boundary_indices.shape[1]
    BK, BV, num_warps = (check_tile(config, K) if config is not None
                         else gdn_tile_config(K, V, "commit", state.dtype, B))
    if B == 0 or NL == 0:
        return
    grid = (triton.cdiv(V, BV), B * HV, NL)
    gdn_commit_kernel[grid](
        state_ptr=state, ru_ptr=rec_u, rk_ptr=rec_k, rd_ptr=rec_decay, qsl_ptr=query_start_loc,
        src_ptr=src_indices, n_ptr=num_accepted_tokens, dst_ptr=dst_indices, bidx_ptr=boundary_indices,
        boff_ptr=boundary_offsets,
        T=T, S=S, NBD=NBD,
        **strides(state, "s_sl", "s_ss", "s_sh", "s_sk", "s_sv"),
        **strides(rec_u, "s_rul", "s_rut", "s_ruh", "s_ruv"), **strides(rec_k, "s_rkl", "s_rkt", "s_rkh", "s_rkk"),
        **strides(rec_decay, "s_rdl", "s_rdt", "s_rdh"),
        **commit_metadata_strides(query_start_loc, src_indices, num_accepted_tokens, dst_indices, boundary_indices,
                                  boundary_offsets),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_PTX=use_ptx(), num_warps=num_warps,
    )


# ----------------------------------------------------------------------------- CPU


def gdn_commit_cpu(state, rec_u, rec_k, rec_decay, query_start_loc, src_indices,
                   num_accepted_tokens, dst_indices, boundary_indices, boundary_offsets):
    """CPU twin of :func:`gdn_commit_kernel` built on :func:`reference.gdn_replay_update`."""
    state, rec_u, rec_k, rec_decay = _grouped(state, rec_u, rec_k, rec_decay)
    NL, S, HV = state.shape[:3]
    T = rec_u.shape[1]
    group = HV // rec_k.shape[2]
    qsl = query_start_loc.tolist()
    counts = num_accepted_tokens.tolist()
    dsts = dst_indices.tolist()
    bidx = boundary_indices.tolist()
    boff = boundary_offsets.tolist()
    rows = []
    for b, src in enumerate(src_indices.tolist()):
        bos, eos = clamped_window(qsl, b, T)
        n = clamped_count(counts[b], bos, eos)
        if n and 0 <= src < S:
            rows.append((b, src, bos, n))
    rows = _commit_rows_batched(rows, state, rec_u, rec_k, rec_decay, dsts, bidx, group)
    for b, src, bos, n in rows:
        for layer in range(NL):
            h = state[layer, src].to(torch.float32).clone()
            for t in range(n):
                tok = bos + t
                h = reference.gdn_replay_update(
                    h, rec_k[layer, tok].repeat_interleave(group, 0), rec_u[layer, tok],
                    rec_decay[layer, tok])
                for j, off in enumerate(boff[b]):
                    if off == t + 1 and 0 <= bidx[b][j] < S:
                        state[layer, bidx[b][j]] = h
            if 0 <= dsts[b] < S:
                state[layer, dsts[b]] = h


def _commit_rows_batched(rows, state, rec_u, rec_k, rec_decay, dsts, bidx, group):
    """:func:`gdn_commit_cpu`'s rows without boundary entries in groups of one count, every layer
    of a group replayed at once (the same elementwise expressions per element, so each state
    gets exactly what it gets alone); returns the rows left for the per-row path."""
    S = state.shape[1]
    groups: dict[int, list] = {}
    rest = []
    for row in rows:
        b = row[0]
        (rest if any(0 <= i < S for i in bidx[b]) else groups.setdefault(row[3], [])).append(row)
    for n, members in groups.items():
        if len(members) == 1:
            rest.extend(members)
            continue
        srcs = torch.tensor([src for _, src, _, _ in members], device=state.device)
        h = state[:, srcs].to(torch.float32)  # [NL, R, HV, K, V]
        NL, R, HV = h.shape[:3]
        h = h.reshape(NL * R * HV, *h.shape[3:])
        for t in range(n):
            tok = torch.tensor([bos + t for _, _, bos, _ in members], device=state.device)
            k = rec_k[:, tok].repeat_interleave(group, 2).reshape(NL * R * HV, -1)
            h = reference.gdn_replay_update(h, k, rec_u[:, tok].reshape(NL * R * HV, -1),
                                            rec_decay[:, tok].reshape(NL * R * HV))
        h = h.reshape(NL, R, HV, *h.shape[1:])
        keep = [i for i, (b, _, _, _) in enumerate(members) if 0 <= dsts[b] < S]
        if keep:
            dst = torch.tensor([dsts[members[i][0]] for i in keep], device=state.device)
            state[:, dst] = h[:, keep].to(state.dtype)
    return rest


# ----------------------------------------------------------------------------- checks


def check_gdn_commit_structure(state, rec_u, rec_k, rec_decay, query_start_loc, src_indices,
                               num_accepted_tokens, dst_indices, boundary_indices, boundary_offsets,
                               rec="rec_"):
    """Ranks, shapes, dtypes and devices of ``gdn_commit``'s arguments (no host sync).

    Each size is taken from every argument that carries it and the one that disagrees is named
    (:func:`~ssm_spec.ops._validate.check_dims`). ``rec``: the prefix of the record's names
    (``rec_u``, ... for the op; ``record.`` for the wrapper, whose caller passed ``record``).
    """
    op = "gdn_commit"
    check_tensor(op, "state", state, ndim=(4, 5), dtypes=STATE_DTYPES)
    dev = state.device
    grouped = state.dim() == 5
    lead = 1 if grouped else 0
    context = ("the grouped state [NL, S, HV, K, V] takes the grouped record [NL, T, ...]" if grouped
               else "the state [S, HV, K, V] takes the record [T, ...]")
    names = dict(u=f"{rec}u", k=f"{rec}k", decay=f"{rec}decay")
    for field, t, ndim in (("u", rec_u, 3), ("k", rec_k, 3), ("decay", rec_decay, 2)):
        check_tensor(op, names[field], t, dtypes=(torch.float32,), device=dev)
        if t.dim() != ndim + lead:
            fail(op, names[field], f"a {t.dim()}-D tensor of shape {list(t.shape)}", f"{ndim + lead}-D ({context})")
    shapes = {"state": state.shape, names["u"]: rec_u.shape, names["k"]: rec_k.shape, names["decay"]: rec_decay.shape}

    def dims(name, *where):
        return check_dims(op, name, {arg: (shapes[arg][i], shapes[arg]) for arg, i in where})

    if grouped:
        dims("NL", ("state", 0), (names["u"], 0), (names["k"], 0), (names["decay"], 0))
    dims("T", (names["u"], lead), (names["k"], lead), (names["decay"], lead))
    HV = dims("HV", ("state", lead + 1), (names["u"], lead + 1), (names["decay"], lead + 1))
    dims("K", ("state", lead + 2), (names["k"], lead + 2))
    dims("V", ("state", lead + 3), (names["u"], lead + 2))
    H = rec_k.shape[-2]
    if H == 0 or HV % H != 0:
        raise ValueError(f"{op}: {names['k']}: got {H} key heads for {HV} value heads (state); expected HV % H == 0")
    check_commit_metadata(op, dev, query_start_loc, src_indices, num_accepted_tokens, dst_indices,
                          boundary_indices, boundary_offsets)


# ----------------------------------------------------------------------------- the op


@define_op("gdn_commit", mutates_args=("state",), cpu=gdn_commit_cpu, cuda=launch_gdn_commit)
def gdn_commit_op(
    kernel, state: torch.Tensor, rec_u: torch.Tensor, rec_k: torch.Tensor, rec_decay: torch.Tensor,
    query_start_loc: torch.Tensor, src_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
    dst_indices: torch.Tensor, boundary_indices: torch.Tensor, boundary_offsets: torch.Tensor,
) -> None:
    """``torch.ops.ssm_spec.gdn_commit``: docs/design.md section 4.1. ``kernel``: the CPU twin
    or the CUDA launcher."""
    args = (state, rec_u, rec_k, rec_decay, query_start_loc, src_indices, num_accepted_tokens,
            dst_indices, boundary_indices, boundary_offsets)
    check_gdn_commit_structure(*args)
    kernel(*args)


# ----------------------------------------------------------------------------- wrapper


def gdn_commit(state, record, query_start_loc, src_indices, num_accepted_tokens,
               dst_indices=None, boundary_indices=None, boundary_offsets=None, validate=None):
    """Replay the first ``n`` recorded tokens of each window and write the state once.

    Args:
        state: ``[S, HV, K, V]`` float32/bfloat16 pool, or ``[NL, S, HV, K, V]`` for the
            grouped form (one launch for every layer); **mutated**.
        record: the :class:`ReplayRecord` of the verify (``[NL, T, ...]`` when grouped).
        query_start_loc: ``[B + 1]`` int32, the verify's windows.
        src_indices: ``[B]`` int32 checkpoint slot per row (``< 0``: padding row, nothing
            read or written).
        num_accepted_tokens: ``[B]`` int32 on the device, ``0 <= n[b] <= window length``;
            ``n = 0`` writes nothing at all.
        dst_indices: ``[B]`` int32 destination of the state after ``n`` tokens (default
            ``src_indices``; ``< 0``: not written). ``dst != src`` keeps the checkpoint.
        boundary_indices, boundary_offsets: ``[B, NBd]`` int32; entry ``j`` receives the
            state after ``boundary_offsets[b, j]`` tokens iff its index is ``>= 0`` and
            ``1 <= offset <= n`` (otherwise skipped, not an error). Default: none.
        validate: host-side value checks (``None``: on in eager, off while compiling).

    A bfloat16 pool is replayed in fp32 and rounded once per store (docs/design.md section 2.5).

    Raises:
        ValueError: naming the argument: bad shapes/dtypes/devices (a record field as
            ``record.u``; a state and record that disagree on a size name the one that differs
            from the others, or both), a slot ``>= S``, a count outside ``0..window length``,
            two rows writing one slot, or a row writing another row's source slot (every live
            row's checkpoint counts, also one accepting nothing; with ``dst_indices`` left out
            the written slots are ``src_indices``), an expanded pool, or (validation on) a
            ``query_start_loc`` that gives a writing row another window than the record's verify
            gave it (known for a record as a verify wrapper returned it, validation on). Nothing
            is written. Also: inputs that require grad while grad mode is on, ``validate=True``
            while compiling or capturing.
    """
    op = "gdn_commit"
    do_validate = should_validate(validate, op)
    dst_arg = "dst_indices" if dst_indices is not None else "src_indices"
    dst_indices, boundary_indices, boundary_offsets = commit_defaults(
        op, src_indices, dst_indices, boundary_indices, boundary_offsets)
    if not (isinstance(record, tuple) and len(record) == 3):
        raise ValueError(f"{op}: record: got {type(record).__name__}; expected the ReplayRecord "
                         "(u, k, decay) returned by gdn_verify")
    args = (state, record[0], record[1], record[2], query_start_loc, src_indices,
            num_accepted_tokens, dst_indices, boundary_indices, boundary_offsets)
    if do_validate:
        check_gdn_commit_structure(*args, rec="record.")
        check_no_grad(op, state=state)
        check_unaliased_pool(op, "state", state)
        check_commit_values("gdn_commit", state.shape[-4], record[0].shape[-3], query_start_loc,
                            src_indices, num_accepted_tokens, dst_indices, boundary_indices,
                            boundary_offsets, dst_arg=dst_arg, made_with=_layout.made_with(record[0]))
    torch.ops.ssm_spec.gdn_commit(*args)
