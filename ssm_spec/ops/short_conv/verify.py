"""``short_conv_verify``: the causal (dilated) depthwise short conv over a verify window.

Reads each row's conv state read-only, writes the outputs and records the window inputs
(``rec_x``, fp32) for the commit. Kernel, launcher, CPU implementation, registration and
wrapper together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import reference
from .. import _layout
from .._launch import strides
from .._library import define_op
from .._validate import (
    FLOAT_DTYPES,
    check_index,
    check_no_grad,
    check_scalars,
    check_tensor,
    should_validate,
    slot_values,
    window_bounds,
)
from .._window import clamped_window, load_window
from ..gdn.tiles import next_power_of_2


def conv_block_c(C: int) -> int:
    """Channels per program (shared by verify and commit)."""
    return min(next_power_of_2(C), 256)


# ----------------------------------------------------------------------------- Triton


@triton.jit
def short_conv_verify_kernel(
    x_ptr, w_ptr, bias_ptr, cs_ptr, idx_ptr, qsl_ptr, out_ptr, rx_ptr,
    T, S, C,
    s_xt, s_xc, s_wc, s_wj, s_bias, s_cs, s_cl, s_cc, s_idx, s_qsl, s_ot, s_oc, s_rt, s_rc,
    KS: tl.constexpr, DIL: tl.constexpr, LC: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """One program per (channel tile, row). Taps before the window come from the conv state
    (``x_{-m} = state[Lc - m]``); nothing is written to the state."""
    i_c = tl.program_id(0)
    i_b = tl.program_id(1)
    slot = tl.load(idx_ptr + i_b * s_idx).to(tl.int64)
    bos, eos = load_window(qsl_ptr, i_b, s_qsl, T)
    if (slot >= 0) & (slot < S):
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        p_state = cs_ptr + slot * s_cs + o_c * s_cc
        t = bos.to(tl.int64)  # int64 token offsets
        while t < eos:  # a while loop: Triton 3.6's interpreter cannot range() over loaded bounds
            if HAS_BIAS:
                acc = tl.load(bias_ptr + o_c * s_bias, mask=m_c, other=0).to(tl.float32)
            else:
                acc = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(KS):
                pos = t - bos - (KS - 1 - j) * DIL  # position relative to the window start
                in_window = tl.full([BC], pos, tl.int64) >= 0
                from_x = tl.load(x_ptr + (t - (KS - 1 - j) * DIL) * s_xt + o_c * s_xc,
                                 mask=m_c & in_window, other=0).to(tl.float32)
                from_state = tl.load(p_state + (LC + pos) * s_cl, mask=m_c & (~in_window),
                                     other=0).to(tl.float32)
                w = tl.load(w_ptr + o_c * s_wc + j * s_wj, mask=m_c, other=0).to(tl.float32)
                acc = acc + w * tl.where(in_window, from_x, from_state)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            x_t = tl.load(x_ptr + t * s_xt + o_c * s_xc, mask=m_c, other=0).to(tl.float32)
            tl.store(out_ptr + t * s_ot + o_c * s_oc, acc.to(out_ptr.dtype.element_ty), mask=m_c)
            tl.store(rx_ptr + t * s_rt + o_c * s_rc, x_t, mask=m_c)
            t += 1


def launch_short_conv_verify(x, weight, bias, conv_state, state_indices, query_start_loc, out,
                             rec_x, dilation, activation):
    """Launch :func:`short_conv_verify_kernel` (no allocation; grid from shapes)."""
    T, C = x.shape
    KS = weight.shape[1]
    B = state_indices.shape[0]
    BC = conv_block_c(C)
    if B == 0:
        return
    has_bias = bias is not None
    b = bias if has_bias else weight
    grid = (triton.cdiv(C, BC), B)
    short_conv_verify_kernel[grid](
        x_ptr=x, w_ptr=weight, bias_ptr=b, cs_ptr=conv_state, idx_ptr=state_indices, qsl_ptr=query_start_loc,
        out_ptr=out, rx_ptr=rec_x,
        T=T, S=conv_state.shape[0], C=C,
        **strides(x, "s_xt", "s_xc"), **strides(weight, "s_wc", "s_wj"), s_bias=b.stride(0),
        **strides(conv_state, "s_cs", "s_cl", "s_cc"), s_idx=state_indices.stride(0),
        s_qsl=query_start_loc.stride(0), **strides(out, "s_ot", "s_oc"), **strides(rec_x, "s_rt", "s_rc"),
        KS=KS, DIL=dilation, LC=(KS - 1) * dilation, BC=BC, HAS_BIAS=has_bias,
        SILU=activation == "silu", num_warps=4,
    )


# ----------------------------------------------------------------------------- CPU


def short_conv_verify_cpu(x, weight, bias, conv_state, state_indices, query_start_loc, out,
                          rec_x, dilation, activation):
    """CPU twin of the kernel: the reference's expressions, row by row."""
    T, S = x.shape[0], conv_state.shape[0]
    qsl = query_start_loc.tolist()
    groups: dict[int, list] = {}
    for b, slot in enumerate(state_indices.tolist()):
        bos, eos = clamped_window(qsl, b, T)
        if 0 <= slot < S and eos > bos:
            groups.setdefault(eos - bos, []).append((slot, bos, eos))
    for length, rows in groups.items():
        if len(rows) > 1:  # rows of one window length as one sequence of R * C channels (elementwise: same bits)
            R, C = len(rows), x.shape[1]
            idx = torch.stack([torch.arange(bos, eos, device=x.device) for _, bos, eos in rows])  # [R, L]
            xs = x[idx].transpose(0, 1).reshape(length, R * C)
            init = conv_state[torch.tensor([slot for slot, _, _ in rows], device=x.device)]
            res = reference.short_conv_native_step(xs, weight.repeat(R, 1), None if bias is None else bias.repeat(R),
                                                   init.transpose(0, 1).reshape(init.shape[1], R * C), dilation,
                                                   activation, dtype=torch.float32)
            out[idx.reshape(-1)] = res.out.reshape(length, R, C).transpose(0, 1).reshape(R * length, C).to(out.dtype)
            rec_x[idx.reshape(-1)] = x[idx.reshape(-1)].to(rec_x.dtype)
            continue
        slot, bos, eos = rows[0]
        res = reference.short_conv_native_step(x[bos:eos], weight, bias, conv_state[slot],
                                               dilation, activation, dtype=torch.float32)
        out[bos:eos] = res.out
        rec_x[bos:eos] = x[bos:eos]


# ----------------------------------------------------------------------------- checks


def check_short_conv_verify_structure(x, weight, bias, conv_state, state_indices,
                                      query_start_loc, out, rec_x, dilation, activation):
    """Ranks, shapes, dtypes, devices and static arguments (no host sync)."""
    op = "short_conv_verify"
    check_tensor(op, "conv_state", conv_state, ndim=3, dtypes=FLOAT_DTYPES)
    dev = conv_state.device
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    T, C = x.shape
    check_tensor(op, "weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    if weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"{op}: weight: got shape {list(weight.shape)}; expected [C={C}, kernel_size >= 1]")
    check_scalars(op, dilation=dilation, activation=activation)
    lc = (weight.shape[1] - 1) * dilation
    check_tensor(op, "conv_state", conv_state, shape=(None, lc, C))
    if bias is not None:
        check_tensor(op, "bias", bias, shape=(C,), dtypes=FLOAT_DTYPES, device=dev)
    check_index(op, "query_start_loc", query_start_loc, None, dev)
    B = query_start_loc.shape[0] - 1
    if B < 0:
        raise ValueError(f"{op}: query_start_loc: got an empty tensor; expected [B + 1] entries")
    check_index(op, "state_indices", state_indices, B, dev)
    check_tensor(op, "out", out, shape=(None, C), dtypes=(x.dtype,), device=dev)
    if out.shape[0] < T:
        raise ValueError(f"{op}: out: got {out.shape[0]} token rows; expected at least {T}")
    check_tensor(op, "rec_x", rec_x, shape=(out.shape[0], C), dtypes=(torch.float32,), device=dev)


# ----------------------------------------------------------------------------- the op


@define_op("short_conv_verify", mutates_args=("out", "rec_x"), cpu=short_conv_verify_cpu,
           cuda=launch_short_conv_verify)
def short_conv_verify_op(
    kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    state_indices: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
    rec_x: torch.Tensor, dilation: int, activation: str,
) -> None:
    """``torch.ops.ssm_spec.short_conv_verify``: docs/design.md section 4.1. ``kernel``: the CPU
    twin or the CUDA launcher."""
    args = (x, weight, bias, conv_state, state_indices, query_start_loc, out, rec_x, dilation,
            activation)
    check_short_conv_verify_structure(*args)
    _layout.forget(rec_x)
    kernel(*args)


# ----------------------------------------------------------------------------- wrapper


def short_conv_verify(x, weight, bias, conv_state, state_indices, query_start_loc, dilation=1,
                      activation="silu", validate=None):
    """Causal depthwise conv over each row's verify window, state read only.

    ``y_t[c] = act(bias[c] + sum_j weight[c, j] * x_{t-(ks-1-j)*D}[c])`` with inputs before
    the window taken from the row's conv state (the last ``Lc = (ks - 1) * D`` inputs, oldest
    first); PyTorch's ``conv1d`` convention with left padding (docs/design.md section 2.2).

    Args:
        x: ``[T, C]`` float32/bfloat16/float16, any strides.
        weight: ``[C, kernel_size]``; bias: ``[C]`` or None.
        conv_state: ``[S, Lc, C]`` pool, **read only**.
        state_indices: ``[B]`` int32 (``< 0``: padding row, nothing read or written).
        query_start_loc: ``[B + 1]`` int32.
        dilation: ``D >= 1``. activation: ``"silu"`` or ``"none"``.
        validate: host-side value checks (``None``: on in eager, off while compiling).

    Returns:
        ``(out [T, C] in x's dtype, rec_x [T, C] float32)``: the outputs and the recorded window
        inputs for :func:`ssm_spec.ops.short_conv_commit` (with validation on, ``rec_x``
        remembers ``query_start_loc``'s windows, and the commit refuses it with others).

    Raises:
        ValueError: naming the argument, before anything is written: bad shapes, dtypes
            (float32/bfloat16/float16 for x, weight, bias and conv_state) or devices, a state
            length other than ``(kernel_size - 1) * dilation``, a dilation < 1 or a bool, an
            unknown activation, a slot ``>= S``, a malformed ``query_start_loc``. Also: inputs that require grad while grad mode is on,
            ``validate=True`` while compiling or capturing.
    """
    op = "short_conv_verify"
    do_validate = should_validate(validate, op)
    if do_validate:
        check_tensor(op, "x", x, ndim=2)
        check_scalars(op, dilation=dilation, activation=activation)
        check_no_grad(op, x=x, weight=weight, bias=bias, conv_state=conv_state)
    T, C = x.shape
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    rec_x = torch.empty((T, C), dtype=torch.float32, device=x.device)
    args = (x, weight, bias, conv_state, state_indices, query_start_loc, out, rec_x, dilation,
            activation)
    if do_validate:
        check_short_conv_verify_structure(*args)
        windows = window_bounds("short_conv_verify", query_start_loc, T)
        slot_values("short_conv_verify", "state_indices", state_indices, conv_state.shape[0])
    torch.ops.ssm_spec.short_conv_verify(*args)
    if do_validate:  # short_conv_commit refuses rec_x with other windows
        _layout.remember(rec_x, windows)
    return out, rec_x
