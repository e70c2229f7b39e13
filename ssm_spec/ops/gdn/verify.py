"""``gdn_verify``: run a verify window from a read-only checkpoint and record the replay record.

The op's registration and its friendly wrapper. The kernel it runs, :func:`gdn_window_kernel`
(``window.py``), also serves the native snapshot op (``snapshot.py``) and the folded verify
(``folded.py``): one kernel body, so they compute the same bits.
"""

from __future__ import annotations

import torch

from .. import _layout
from .._library import define_op
from .._validate import log_decay_values, slot_values, window_bounds
from .record import ReplayRecord
from .window import check_gdn_window_structure, gdn_window_cpu, launch_gdn_window, prepare_window_call
from .window import gdn_window_kernel  # noqa: F401  (scripts import it from here)

# ----------------------------------------------------------------------------- the op


@define_op("gdn_verify", mutates_args=("out", "rec_u", "rec_k", "rec_decay"), cpu=gdn_window_cpu,
           cuda=launch_gdn_window)
def gdn_verify_op(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    out: torch.Tensor, rec_u: torch.Tensor, rec_k: torch.Tensor, rec_decay: torch.Tensor,
    scale: float, use_qk_l2norm: bool,
) -> None:
    """``torch.ops.ssm_spec.gdn_verify``: docs/design.md section 4.1. ``kernel``: the CPU twin or
    the CUDA launcher of the window kernel."""
    check_gdn_window_structure("gdn_verify", q, k, v, g, beta, state, state_indices,
                               query_start_loc, out, rec_u, rec_k, rec_decay)
    _layout.forget(rec_u)
    kernel(q, k, v, g, beta, state, state_indices, query_start_loc, None, out,
           (rec_u, rec_k, rec_decay), scale, use_qk_l2norm)


# ----------------------------------------------------------------------------- wrapper


def gdn_verify(q, k, v, g, beta, state, state_indices, query_start_loc, scale=None,
               use_qk_l2norm=True, validate=None):
    """Verify a window of tokens per row from a read-only checkpoint (RecoverSSM, docs/design.md §1-4).

    Args:
        q, k: ``[T, H, K]`` float32/bfloat16/float16, any strides (views of the conv output).
        v: ``[T, HV, V]``, same dtypes; ``HV % H == 0``; value head ``i`` uses key head
            ``i // (HV // H)``.
        g: ``[T, HV]`` float32 log decay (``<= 0``). beta: ``[T, HV]`` float.
        state: ``[S, HV, K, V]`` float32 or bfloat16 pool; **read only**.
        state_indices: ``[B]`` int32 checkpoint slot of each row; ``< 0`` is a padding row
            (reads and writes nothing).
        query_start_loc: ``[B + 1]`` int32; row ``b`` owns tokens ``[qsl[b], qsl[b+1])``.
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: L2-normalise q and k (``x / sqrt(sum(x*x) + 1e-6)``).
        validate: host-side value checks; ``None`` = on in eager, off while compiling/capturing.

    Returns:
        ``(out, record)``: ``out [T, HV, V]`` in ``v``'s dtype and a :class:`ReplayRecord`.
        Tokens outside every window and tokens of padding rows are left uninitialised.

    With validation on, the record remembers ``query_start_loc``'s values, and
    :func:`~ssm_spec.ops.gdn_commit` refuses it with other windows.

    Raises:
        ValueError: naming the argument, for bad shapes, dtypes, devices (a size two arguments
            disagree on names the one that differs from the others: ``state`` for a pool of
            another layer), a slot ``>= S``, a malformed ``query_start_loc``, or (validation on)
            a ``g > 0`` or NaN on a token of a live row; nothing is written. Also: inputs that
            require grad while grad mode is on, ``validate=True`` while compiling or capturing.
    """
    do_validate, scale, out = prepare_window_call("gdn_verify", q, k, v, g, beta, state, scale,
                                                  use_qk_l2norm, validate)
    T = q.shape[0]
    record = ReplayRecord.empty(q, v)
    if do_validate:
        check_gdn_window_structure("gdn_verify", q, k, v, g, beta, state, state_indices,
                                   query_start_loc, out, *record)
        windows = window_bounds("gdn_verify", query_start_loc, T)
        slots = slot_values("gdn_verify", "state_indices", state_indices, state.shape[0])
        log_decay_values("gdn_verify", g, windows, slots)
    torch.ops.ssm_spec.gdn_verify(q, k, v, g, beta, state, state_indices, query_start_loc,
                                  out, record.u, record.k, record.decay, scale, use_qk_l2norm)
    if do_validate:
        _layout.remember(record.u, windows)
    return out, record
