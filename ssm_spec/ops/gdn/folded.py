"""``gdn_folded_verify``: the previous step's commit folded into this step's verify.

Per row: replay the accepted tokens of the row's *previous* window from the previous step's
replay record onto its checkpoint, store that state once (in the pool's dtype), then verify
the new window from the stored value and record it. A step then moves one state read and
one state write per row, layer and value head, the floor for any scheme that keeps a
committed state every step (separate verify + commit read the state
twice and write it once).

It runs the verify kernel itself (:func:`~ssm_spec.ops.gdn.window.gdn_window_kernel` with its
``fold`` flag), whose fold uses the commit's elementwise update, so states and outputs are
bit-identical to ``gdn_commit`` followed by ``gdn_verify``. Records must be double-buffered
by the caller: this step's records may not overlap the previous step's.
"""

from __future__ import annotations

import torch

from .. import _layout
from .._library import define_op
from .._validate import (
    check_index,
    check_tensor,
    check_unaliased_pool,
    check_write_conflicts,
    fail,
    log_decay_values,
    slot_values,
    window_bounds,
)
from .record import ReplayRecord
from .window import check_gdn_window_structure, gdn_window_cpu, launch_gdn_window, prepare_window_call

OP = "gdn_folded_verify"


def _check_fold_structure(state, rec_k, prev_rec_u, prev_rec_k, prev_rec_decay, prev_start,
                          prev_num_accepted_tokens, batch, prev="prev_rec_"):
    """The previous record's and counts' structure; ``prev``: the prefix of the previous
    record's names (``prev_rec_u``, ... for the op; ``prev_record.`` for the wrapper)."""
    dev = state.device
    HV, K, V = state.shape[1:]
    H = rec_k.shape[1]
    check_tensor(OP, f"{prev}u", prev_rec_u, ndim=3, dtypes=(torch.float32,), device=dev)
    TP = prev_rec_u.shape[0]
    check_tensor(OP, f"{prev}u", prev_rec_u, shape=(TP, HV, V))
    check_tensor(OP, f"{prev}k", prev_rec_k, shape=(TP, H, K), dtypes=(torch.float32,), device=dev)
    check_tensor(OP, f"{prev}decay", prev_rec_decay, shape=(TP, HV), dtypes=(torch.float32,), device=dev)
    check_index(OP, "prev_start", prev_start, batch, dev)
    check_index(OP, "prev_num_accepted_tokens", prev_num_accepted_tokens, batch, dev)


@define_op(OP, mutates_args=("state", "out", "rec_u", "rec_k", "rec_decay"), cpu=gdn_window_cpu,
           cuda=launch_gdn_window)
def gdn_folded_verify_op(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    out: torch.Tensor, rec_u: torch.Tensor, rec_k: torch.Tensor, rec_decay: torch.Tensor,
    prev_rec_u: torch.Tensor, prev_rec_k: torch.Tensor, prev_rec_decay: torch.Tensor,
    prev_start: torch.Tensor, prev_num_accepted_tokens: torch.Tensor,
    scale: float, use_qk_l2norm: bool,
) -> None:
    """``torch.ops.ssm_spec.gdn_folded_verify`` (module docstring). ``kernel``: the CPU twin or
    the CUDA launcher of the window kernel, in its fold mode."""
    check_gdn_window_structure(OP, q, k, v, g, beta, state, state_indices, query_start_loc, out,
                               rec_u, rec_k, rec_decay)
    _check_fold_structure(state, rec_k, prev_rec_u, prev_rec_k, prev_rec_decay, prev_start,
                          prev_num_accepted_tokens, state_indices.shape[0])
    _layout.forget(rec_u)
    kernel(q, k, v, g, beta, state, state_indices, query_start_loc, None, out,
           (rec_u, rec_k, rec_decay), scale, use_qk_l2norm,
           fold=(prev_rec_u, prev_rec_k, prev_rec_decay, prev_start, prev_num_accepted_tokens))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect (same storage)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    hi_a = lo_a + sum((n - 1) * s for n, s in zip(a.shape, a.stride())) * a.element_size() + a.element_size()
    hi_b = lo_b + sum((n - 1) * s for n, s in zip(b.shape, b.stride())) * b.element_size() + b.element_size()
    return a.numel() > 0 and b.numel() > 0 and lo_a < hi_b and lo_b < hi_a


def gdn_folded_verify(q, k, v, g, beta, state, state_indices, query_start_loc, prev_record, prev_start,
                      prev_num_accepted_tokens, scale=None, use_qk_l2norm=True, record=None, validate=None):
    """Commit each row's previous window into its checkpoint, then verify the new window.

    Equal, bit for bit, to ``gdn_commit(state, prev_record, ...)`` with each row's previous
    window and count, followed by ``gdn_verify`` (both in place, ``dst = src``): one state read
    and one state write per row instead of two reads and a write.

    Args:
        q, k, v, g, beta, state_indices, query_start_loc, scale, use_qk_l2norm: as
            :func:`ssm_spec.ops.gdn_verify` (``state_indices[b]`` is also the slot the fold
            writes).
        state: ``[S, HV, K, V]`` float32/bfloat16 pool, **mutated**: a row with
            ``prev_num_accepted_tokens[b] > 0`` stores its committed state (rounded once to
            the pool's dtype; the verify continues from the stored value, as a separate
            commit's store and reload would). Rows with a count of 0 leave it untouched.
        prev_record: the :class:`ReplayRecord` ``([TP, HV, V], [TP, H, K], [TP, HV])`` the
            previous step's verify wrote; must not overlap ``record``.
        prev_start: ``[B]`` int32, where row ``b``'s previous window starts in ``prev_record``.
        prev_num_accepted_tokens: ``[B]`` int32, tokens of that window to commit (``0``:
            nothing pending, e.g. a row's first verify after prefill).
        record: the buffers for this step's record (default: newly allocated, ``[T, ...]``).
        validate: host-side value checks (``None``: on in eager, off while compiling).

    Returns:
        ``(out [T, HV, V], record)``.

    Raises:
        ValueError: naming the argument, before anything is written: what
            :func:`~ssm_spec.ops.gdn_verify` rejects, prev record shapes or dtypes that do
            not fit (named ``prev_record.u`` ...; ``record.u`` ... for ``record``), a previous
            window outside ``prev_record``, a negative count, two rows writing one slot,
            overlapping records, an expanded pool, a ``g > 0`` or NaN on a token of a live row.
            With validation on, the record remembers ``query_start_loc``'s windows for
            :func:`~ssm_spec.ops.gdn_commit`.
    """
    do_validate, scale, out = prepare_window_call(OP, q, k, v, g, beta, state, scale, use_qk_l2norm, validate)
    T, H, K = q.shape
    HV, V = v.shape[-2:]
    if record is None:
        record = ReplayRecord.empty(q, v)
    if not (isinstance(prev_record, tuple) and len(prev_record) == 3):
        fail(OP, "prev_record", type(prev_record).__name__, "the ReplayRecord (u, k, decay) of the previous verify")
    if do_validate:
        check_unaliased_pool(OP, "state", state)
        check_gdn_window_structure(OP, q, k, v, g, beta, state, state_indices, query_start_loc, out, *record,
                                   rec="record.")
        _check_fold_structure(state, record[1], *prev_record, prev_start, prev_num_accepted_tokens,
                              state_indices.shape[0], prev="prev_record.")
        for name, a, b in zip(("u", "k", "decay"), record, prev_record):
            if _overlaps(a, b):
                fail(OP, f"prev_record.{name}", "memory overlapping this step's record",
                     "a separate buffer (double-buffer the records across steps)")
        windows = window_bounds(OP, query_start_loc, T)
        slots = slot_values(OP, "state_indices", state_indices, state.shape[0])
        log_decay_values(OP, g, windows, slots)
        TP = prev_record[0].shape[0]
        for b, (p0, pn) in enumerate(zip(prev_start.tolist(), prev_num_accepted_tokens.tolist())):
            if pn < 0 or (pn > 0 and not 0 <= p0 <= TP - pn):
                fail(OP, f"prev_start[{b}] / prev_num_accepted_tokens[{b}]", f"{p0} / {pn}",
                     f"a count >= 0 and a window inside the {TP} recorded tokens")
        live = {b: s for b, s in enumerate(slots) if s >= 0}
        check_write_conflicts(OP, {}, [(b, s, f"state_indices[{b}]") for b, s in live.items()])
    torch.ops.ssm_spec.gdn_folded_verify(q, k, v, g, beta, state, state_indices, query_start_loc, out,
                                         record[0], record[1], record[2], *prev_record, prev_start,
                                         prev_num_accepted_tokens, scale, use_qk_l2norm)
    if do_validate:  # gdn_commit refuses the record with other windows
        _layout.remember(record[0], windows)
    return out, record
