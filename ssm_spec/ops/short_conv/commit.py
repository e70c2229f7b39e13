"""``short_conv_commit``: compact the conv state so it holds the last ``Lc`` inputs up to the
``n``-th accepted token (and every boundary), from the checkpoint and the recorded inputs.

Pure data movement, so it is bit exact on every backend. Grouped form: ``conv_state
[NL, S, Lc, C]`` with ``rec_x [NL, T, C]`` for layers of one conv shape, one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _layout
from .._launch import commit_metadata_strides, strides
from .._library import define_op
from .._validate import (
    FLOAT_DTYPES,
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
from ..gdn.tiles import next_power_of_2
from .verify import conv_block_c

# ----------------------------------------------------------------------------- Triton


@triton.jit
def _shifted_state(b_s, rx_ptr, bos, m, o_l, o_c, m_c, s_rt, s_rc,
                   LC: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr):
    """The last ``LC`` inputs after ``m`` window tokens: entry ``i`` is element ``i + m`` of
    ``checkpoint ++ window``, from the registers ``b_s`` (never re-read from the pool, so
    in-place and overlapping writes cannot race) or from the record."""
    j = o_l + m
    idx = tl.broadcast_to(tl.minimum(j, BL - 1)[:, None], (BL, BC))
    from_state = tl.gather(b_s, idx, 0)
    tok = (bos + j - LC).to(tl.int64)
    from_x = tl.load(rx_ptr + tok[:, None] * s_rt + o_c[None, :] * s_rc,
                     mask=(j >= LC)[:, None] & (o_l < LC)[:, None] & m_c[None, :], other=0)
    return tl.where((j < LC)[:, None], from_state, from_x)


@triton.jit
def short_conv_commit_kernel(
    cs_ptr, rx_ptr, qsl_ptr, src_ptr, n_ptr, dst_ptr, bidx_ptr, boff_ptr,
    T, S, C, NBD,
    s_csl, s_css, s_csj, s_csc, s_rxl, s_rt, s_rc,
    s_qsl, s_src, s_n, s_dst, s_bib, s_bij, s_bob, s_boj,
    LC: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr,
):
    """One program per (channel tile, row, layer): reads the whole source tile first."""
    i_c = tl.program_id(0)
    i_b = tl.program_id(1)
    i_l = tl.program_id(2).to(tl.int64)
    bos, eos = load_window(qsl_ptr, i_b, s_qsl, T)
    n = load_count(n_ptr, i_b, s_n, eos - bos)
    src = tl.load(src_ptr + i_b * s_src).to(tl.int64)
    if (n > 0) & (src >= 0) & (src < S):
        o_l = tl.arange(0, BL)
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        m_t = (o_l < LC)[:, None] & m_c[None, :]
        layer = cs_ptr + i_l * s_csl
        rx = rx_ptr + i_l * s_rxl
        tile = o_l[:, None] * s_csj + o_c[None, :] * s_csc
        b_s = tl.load(layer + src * s_css + tile, mask=m_t, other=0).to(tl.float32)
        j = 0
        while j < NBD:  # a while loop: Triton 3.6's interpreter cannot range() over scalar args
            off = tl.load(boff_ptr + i_b * s_bob + j * s_boj)
            bidx = tl.load(bidx_ptr + i_b * s_bib + j * s_bij).to(tl.int64)
            if (off >= 1) & (off <= n) & (bidx >= 0) & (bidx < S):
                b_o = _shifted_state(b_s, rx, bos, off, o_l, o_c, m_c, s_rt, s_rc, LC, BL, BC)
                tl.store(layer + bidx * s_css + tile, b_o.to(cs_ptr.dtype.element_ty), mask=m_t)
            j += 1
        dst = tl.load(dst_ptr + i_b * s_dst).to(tl.int64)
        if (dst >= 0) & (dst < S):
            b_o = _shifted_state(b_s, rx, bos, n, o_l, o_c, m_c, s_rt, s_rc, LC, BL, BC)
            tl.store(layer + dst * s_css + tile, b_o.to(cs_ptr.dtype.element_ty), mask=m_t)


def _grouped(conv_state, rec_x):
    if conv_state.dim() == 3:
        return conv_state.unsqueeze(0), rec_x.unsqueeze(0)
    return conv_state, rec_x


def launch_short_conv_commit(conv_state, rec_x, query_start_loc, src_indices,
                             num_accepted_tokens, dst_indices, boundary_indices, boundary_offsets):
    """Launch :func:`short_conv_commit_kernel` over every layer of the group in one grid."""
    conv_state, rec_x = _grouped(conv_state, rec_x)
    NL, S, LC, C = conv_state.shape
    B = src_indices.shape[0]
    if B == 0 or NL == 0 or LC == 0:
        return
    BC = conv_block_c(C)
    grid = (triton.cdiv(C, BC), B, NL)
    short_conv_commit_kernel[grid](
        cs_ptr=conv_state, rx_ptr=rec_x, qsl_ptr=query_start_loc, src_ptr=src_indices, n_ptr=num_accepted_tokens,
        dst_ptr=dst_indices, bidx_ptr=boundary_indices, boff_ptr=boundary_offsets,
        T=rec_x.shape[1], S=S, C=C, NBD=boundary_indices.shape[1],
        **strides(conv_state, "s_csl", "s_css", "s_csj", "s_csc"), **strides(rec_x, "s_rxl", "s_rt", "s_rc"),
        **commit_metadata_strides(query_start_loc, src_indices, num_accepted_tokens, dst_indices, boundary_indices,
                                  boundary_offsets),
        LC=LC, BL=next_power_of_2(LC), BC=BC, num_warps=4,
    )


# ----------------------------------------------------------------------------- CPU


def short_conv_commit_cpu(conv_state, rec_x, query_start_loc, src_indices, num_accepted_tokens,
                          dst_indices, boundary_indices, boundary_offsets):
    """CPU twin of :func:`short_conv_commit_kernel`."""
    conv_state, rec_x = _grouped(conv_state, rec_x)
    NL, S, LC = conv_state.shape[:3]
    T = rec_x.shape[1]
    qsl = query_start_loc.tolist()
    counts = num_accepted_tokens.tolist()
    dsts = dst_indices.tolist()
    bidx = boundary_indices.tolist()
    boff = boundary_offsets.tolist()
    groups: dict[int, list] = {}
    for b, src in enumerate(src_indices.tolist()):
        bos, eos = clamped_window(qsl, b, T)
        n = clamped_count(counts[b], bos, eos)
        if n == 0 or not 0 <= src < S or LC == 0:
            continue
        if not any(0 <= i < S for i in bidx[b]) and 0 <= dsts[b] < S:  # pure data movement: rows of one count at once
            groups.setdefault(n, []).append((src, bos, dsts[b]))
            continue
        for layer in range(NL):
            hist = torch.cat([conv_state[layer, src].to(torch.float32), rec_x[layer, bos:bos + n]])
            for j, off in enumerate(boff[b]):
                if 1 <= off <= n and 0 <= bidx[b][j] < S:
                    conv_state[layer, bidx[b][j]] = hist[off:off + LC]
            if 0 <= dsts[b] < S:
                conv_state[layer, dsts[b]] = hist[n:n + LC]
    for n, rows in groups.items():
        srcs = torch.tensor([src for src, _, _ in rows], device=conv_state.device)
        tok = torch.stack([torch.arange(bos, bos + n, device=conv_state.device) for _, bos, _ in rows])
        hist = torch.cat([conv_state[:, srcs].to(torch.float32), rec_x[:, tok]], dim=2)  # [NL, R, LC + n, C]
        conv_state[:, torch.tensor([dst for _, _, dst in rows], device=conv_state.device)] = \
            hist[:, :, n:n + LC].to(conv_state.dtype)


# ----------------------------------------------------------------------------- checks


def check_short_conv_commit_structure(conv_state, rec_x, query_start_loc, src_indices,
                                      num_accepted_tokens, dst_indices, boundary_indices,
                                      boundary_offsets):
    """Ranks, shapes, dtypes and devices (no host sync)."""
    op = "short_conv_commit"
    check_tensor(op, "conv_state", conv_state, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    dev = conv_state.device
    check_tensor(op, "rec_x", rec_x, dtypes=(torch.float32,), device=dev)
    if rec_x.dim() != conv_state.dim() - 1:
        context = ("the grouped conv_state [NL, S, Lc, C] takes the grouped rec_x [NL, T, C]" if conv_state.dim() == 4
                   else "the conv_state [S, Lc, C] takes rec_x [T, C]")
        fail(op, "rec_x", f"a {rec_x.dim()}-D tensor of shape {list(rec_x.shape)}",
             f"{conv_state.dim() - 1}-D ({context})")
    if conv_state.dim() == 4:
        check_dims(op, "NL", {"conv_state": (conv_state.shape[0], conv_state.shape), "rec_x": (rec_x.shape[0], rec_x.shape)})
    check_dims(op, "C", {"conv_state": (conv_state.shape[-1], conv_state.shape), "rec_x": (rec_x.shape[-1], rec_x.shape)})
    check_commit_metadata(op, dev, query_start_loc, src_indices, num_accepted_tokens, dst_indices,
                          boundary_indices, boundary_offsets)


# ----------------------------------------------------------------------------- the op


@define_op("short_conv_commit", mutates_args=("conv_state",), cpu=short_conv_commit_cpu,
           cuda=launch_short_conv_commit)
def short_conv_commit_op(
    kernel, conv_state: torch.Tensor, rec_x: torch.Tensor, query_start_loc: torch.Tensor,
    src_indices: torch.Tensor, num_accepted_tokens: torch.Tensor, dst_indices: torch.Tensor,
    boundary_indices: torch.Tensor, boundary_offsets: torch.Tensor,
) -> None:
    """``torch.ops.ssm_spec.short_conv_commit``: docs/design.md section 4.1. ``kernel``: the CPU
    twin or the CUDA launcher."""
    args = (conv_state, rec_x, query_start_loc, src_indices, num_accepted_tokens, dst_indices,
            boundary_indices, boundary_offsets)
    check_short_conv_commit_structure(*args)
    kernel(*args)


# ----------------------------------------------------------------------------- wrapper


def short_conv_commit(conv_state, rec_x, query_start_loc, src_indices, num_accepted_tokens,
                      dst_indices=None, boundary_indices=None, boundary_offsets=None,
                      validate=None):
    """Compact each row's conv state to end at its ``n``-th accepted token.

    After the call, ``dst`` holds the last ``Lc`` inputs of ``checkpoint ++ window[:n]``
    (oldest first), and each boundary entry those of ``checkpoint ++ window[:offset]``.

    Args:
        conv_state: ``[S, Lc, C]`` pool or ``[NL, S, Lc, C]`` grouped; **mutated**.
        rec_x: ``[T, C]`` (``[NL, T, C]``) float32, from :func:`ssm_spec.ops.short_conv_verify`.
        query_start_loc, src_indices, num_accepted_tokens, dst_indices, boundary_indices,
        boundary_offsets, validate: as :func:`ssm_spec.ops.gdn_commit` (same conventions).

    Raises:
        ValueError: naming the argument, before anything is written: as
            :func:`ssm_spec.ops.gdn_commit` (slots, counts, write conflicts, an expanded pool, a
            ``query_start_loc`` other than the one ``rec_x``'s ``short_conv_verify`` was given;
            conv_state float32/bfloat16/float16, rec_x float32). Also: inputs that require grad while grad mode is on,
            ``validate=True`` while compiling or capturing.
    """
    op = "short_conv_commit"
    do_validate = should_validate(validate, op)
    dst_arg = "dst_indices" if dst_indices is not None else "src_indices"
    dst_indices, boundary_indices, boundary_offsets = commit_defaults(
        op, src_indices, dst_indices, boundary_indices, boundary_offsets)
    args = (conv_state, rec_x, query_start_loc, src_indices, num_accepted_tokens, dst_indices,
            boundary_indices, boundary_offsets)
    if do_validate:
        check_short_conv_commit_structure(*args)
        check_no_grad(op, conv_state=conv_state)
        check_unaliased_pool(op, "conv_state", conv_state)
        check_commit_values("short_conv_commit", conv_state.shape[-3], rec_x.shape[-2],
                            query_start_loc, src_indices, num_accepted_tokens, dst_indices,
                            boundary_indices, boundary_offsets, dst_arg=dst_arg,
                            made_with=_layout.made_with(rec_x), record_arg="rec_x")
    torch.ops.ssm_spec.short_conv_commit(*args)
