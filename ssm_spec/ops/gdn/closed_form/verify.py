"""The two closed-form ops, ``gdn_closed_form_verify`` and ``gdn_closed_form_folded_verify``:
their structure checks, registration and friendly wrappers (the algorithm: the package
docstring)."""

from __future__ import annotations

import torch

from ... import _layout
from ..._library import define_op
from ..._validate import (
    check_index,
    check_tensor,
    check_unaliased_pool,
    check_write_conflicts,
    fail,
    log_decay_values,
    slot_values,
    window_bounds,
)
from ..record import ReplayRecord
from ..window import check_gdn_window_structure, prepare_window_call
from .kernel import closed_form_cpu, launch_closed_form
from .ring import ring_positions

# ----------------------------------------------------------------------------- checks


def _check_max_window(op, max_window):
    if isinstance(max_window, bool) or not isinstance(max_window, int) or max_window < 0:
        fail(op, "max_window", repr(max_window), "an int >= 0 (the longest window of the step)")


def _check_ring_structure(op, state, q, ring_u, ring_k, ring_g, pending_start, pending_count, max_window,
                          max_pending, batch, ring="ring_"):
    """The ring's and pending counts' structure; ``ring``: the prefix of the ring's names (``ring_u``,
    ... for the op; ``ring.`` for the wrapper, whose caller passed ``ring``)."""
    dev = state.device
    S, HV, K, V = state.shape
    H = q.shape[1]
    check_tensor(op, f"{ring}u", ring_u, ndim=4, dtypes=(torch.float32,), device=dev)
    R = ring_u.shape[1]
    check_tensor(op, f"{ring}u", ring_u, shape=(S, R, HV, V))
    check_tensor(op, f"{ring}k", ring_k, shape=(S, R, H, K), dtypes=(torch.float32,), device=dev)
    check_tensor(op, f"{ring}g", ring_g, shape=(S, R, HV), dtypes=(torch.float32,), device=dev)
    check_index(op, "pending_start", pending_start, batch, dev)
    check_index(op, "pending_count", pending_count, batch, dev)
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 0:
        fail(op, "max_pending", repr(max_pending), "an int >= 0")
    need = ring_positions(max_pending, max_window)
    if R < need:
        fail(op, f"{ring}u", f"{R} ring positions", f">= max(max_pending, max_window) + max_window = {need}")



# ----------------------------------------------------------------------------- the ops


@define_op("gdn_closed_form_verify", mutates_args=("out", "rec_u", "rec_k", "rec_decay"), cpu=closed_form_cpu,
           cuda=launch_closed_form)
def gdn_closed_form_verify_op(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    out: torch.Tensor, rec_u: torch.Tensor, rec_k: torch.Tensor, rec_decay: torch.Tensor,
    max_window: int, scale: float, use_qk_l2norm: bool,
) -> None:
    """``torch.ops.ssm_spec.gdn_closed_form_verify`` (package docstring). ``kernel``: the CPU twin
    or the CUDA launcher."""
    _check_max_window("gdn_closed_form_verify", max_window)
    check_gdn_window_structure("gdn_closed_form_verify", q, k, v, g, beta, state, state_indices,
                               query_start_loc, out, rec_u, rec_k, rec_decay)
    _layout.forget(rec_u)
    kernel(q, k, v, g, beta, state, state_indices, query_start_loc, out, (rec_u, rec_k, rec_decay), max_window,
           scale, use_qk_l2norm)


FOLDED_OP = "gdn_closed_form_folded_verify"


@define_op(FOLDED_OP, mutates_args=("state", "out", "ring_u", "ring_k", "ring_g"), cpu=closed_form_cpu,
           cuda=launch_closed_form)
def gdn_closed_form_folded_verify_op(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
    ring_u: torch.Tensor, ring_k: torch.Tensor, ring_g: torch.Tensor,
    pending_start: torch.Tensor, pending_count: torch.Tensor,
    max_window: int, max_pending: int, scale: float, use_qk_l2norm: bool,
) -> None:
    """``torch.ops.ssm_spec.gdn_closed_form_folded_verify`` (package docstring). ``kernel``: the
    CPU twin or the CUDA launcher, in its ring mode."""
    _check_max_window(FOLDED_OP, max_window)
    check_gdn_window_structure(FOLDED_OP, q, k, v, g, beta, state, state_indices, query_start_loc, out)
    _check_ring_structure(FOLDED_OP, state, q, ring_u, ring_k, ring_g, pending_start, pending_count, max_window,
                          max_pending, state_indices.shape[0])
    kernel(q, k, v, g, beta, state, state_indices, query_start_loc, out, (ring_u, ring_k, ring_g), max_window,
           scale, use_qk_l2norm, (pending_start, pending_count, max_pending))


# ----------------------------------------------------------------------------- wrappers


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
        ValueError: what ``gdn_verify`` rejects (a ``g > 0`` too); a window longer than
            ``max_window``; no ``max_window`` while compiling or capturing. As ``gdn_verify``'s,
            the record remembers its windows with validation on.
    """
    op = "gdn_closed_form_verify"
    do_validate, scale, out = prepare_window_call(op, q, k, v, g, beta, state, scale, use_qk_l2norm, validate)
    record = ReplayRecord.empty(q, v)
    windows = None
    if do_validate:
        check_gdn_window_structure(op, q, k, v, g, beta, state, state_indices, query_start_loc, out, *record)
        windows = window_bounds(op, query_start_loc, q.shape[0])
        slots = slot_values(op, "state_indices", state_indices, state.shape[0])
        log_decay_values(op, g, windows, slots)
    max_window = _resolve_max_window(op, max_window, windows)
    torch.ops.ssm_spec.gdn_closed_form_verify(q, k, v, g, beta, state, state_indices, query_start_loc, out,
                                              record.u, record.k, record.decay, max_window, scale, use_qk_l2norm)
    if do_validate:  # gdn_commit refuses the record with other windows
        _layout.remember(record.u, windows)
    return out, record


def gdn_closed_form_folded_verify(q, k, v, g, beta, state, state_indices, query_start_loc, ring, pending_start,
                                  pending_count, max_pending, max_window=None, scale=None, use_qk_l2norm=True,
                                  validate=None):
    """Fast mode's folded verify with the lazy commit (package docstring).

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
            than :func:`ring_positions` (named ``ring.u``, ``ring.k``, ``ring.g``), a count outside
            ``0..R - max_window``, two rows writing one slot, an expanded pool, a window longer than
            ``max_window``, a ``g > 0`` or NaN on a token of a live row. Nothing is written.
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
                              state_indices.shape[0], ring="ring.")
        slots = slot_values(op, "state_indices", state_indices, state.shape[0])
        log_decay_values(op, g, windows, slots)
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
