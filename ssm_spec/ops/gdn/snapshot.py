"""``gdn_snapshot_verify``: the native per-draft path engines use today (baseline and oracle).

Reads each row's source slot and, after every token ``t``, writes the state into
``snapshot_indices[t]`` (``< 0``: not written). Runs the same Triton kernel body as verify
(:func:`~ssm_spec.ops.gdn.window.gdn_window_kernel`, its ``STORE_SNAPSHOTS`` mode, on its own tile:
bits do not depend on the tile), so its states are the ones commit reproduces bit for bit.
"""

from __future__ import annotations

import torch

from .._library import define_op
from .._validate import (
    check_index,
    check_unaliased_pool,
    check_write_conflicts,
    log_decay_values,
    slot_values,
    window_bounds,
)
from .window import check_gdn_window_structure, gdn_window_cpu, launch_gdn_window, prepare_window_call


def _check_snapshot_structure(q, k, v, g, beta, state, src_indices, query_start_loc,
                              snapshot_indices, out):
    op = "gdn_snapshot_verify"
    check_gdn_window_structure(op, q, k, v, g, beta, state, src_indices, query_start_loc, out,
                               indices="src_indices")
    check_index(op, "snapshot_indices", snapshot_indices, None, state.device)
    if snapshot_indices.shape[0] < q.shape[0]:
        raise ValueError(f"{op}: snapshot_indices: got {snapshot_indices.shape[0]} entries; "
                         f"expected at least T = {q.shape[0]} (one per token)")


@define_op("gdn_snapshot_verify", mutates_args=("state", "out"), cpu=gdn_window_cpu, cuda=launch_gdn_window)
def gdn_snapshot_verify_op(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, src_indices: torch.Tensor, query_start_loc: torch.Tensor,
    snapshot_indices: torch.Tensor, out: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> None:
    """``torch.ops.ssm_spec.gdn_snapshot_verify``: docs/design.md section 4.1. ``kernel``: the
    CPU twin or the CUDA launcher of the window kernel."""
    _check_snapshot_structure(q, k, v, g, beta, state, src_indices, query_start_loc,
                              snapshot_indices, out)
    kernel(q, k, v, g, beta, state, src_indices, query_start_loc, snapshot_indices, out,
           None, scale, use_qk_l2norm)


def gdn_snapshot_verify(q, k, v, g, beta, state, src_indices, query_start_loc, snapshot_indices,
                        scale=None, use_qk_l2norm=True, validate=None):
    """Native per-draft verify: write the state after every token into its own slot.

    Args:
        q, k, v, g, beta, scale, use_qk_l2norm: as :func:`ssm_spec.ops.gdn_verify`.
        state: ``[S, HV, K, V]`` float32/bfloat16 pool, **mutated** (snapshot slots only).
        src_indices: ``[B]`` int32 source slot per row; ``< 0`` is a padding row.
        query_start_loc: ``[B + 1]`` int32.
        snapshot_indices: ``[T]`` int32, the slot that receives the state after token ``t``
            (``< 0``: not written). A slot may receive one token's state only, and may not be
            another row's source.
        validate: host-side value checks (``None``: on in eager, off while compiling).

    Returns:
        ``out [T, HV, V]`` in ``v``'s dtype (padding rows' tokens uninitialised).

    Raises:
        ValueError: naming the argument, before anything is written: bad shapes, dtypes or
            devices, a slot ``>= S``, a malformed ``query_start_loc``, a snapshot slot written
            twice or that is a live row's source, an expanded pool, a ``g > 0`` or NaN on a
            token of a live row. Also: inputs that require grad while grad mode is on,
            ``validate=True`` while compiling or capturing.
    """
    op = "gdn_snapshot_verify"
    do_validate, scale, out = prepare_window_call(op, q, k, v, g, beta, state, scale, use_qk_l2norm, validate)
    T = q.shape[0]
    if do_validate:
        check_unaliased_pool(op, "state", state)
        _check_snapshot_structure(q, k, v, g, beta, state, src_indices, query_start_loc,
                                  snapshot_indices, out)
        windows = window_bounds(op, query_start_loc, T)
        S = state.shape[0]
        srcs = slot_values(op, "src_indices", src_indices, S)
        snaps = slot_values(op, "snapshot_indices", snapshot_indices, S)
        log_decay_values(op, g, windows, srcs)
        reads = {b: s for b, s in enumerate(srcs) if s >= 0}  # every live checkpoint
        writes = [(b, snaps[t], f"snapshot_indices[{t}]") for b, (bos, eos) in enumerate(windows)
                  if b in reads for t in range(bos, eos) if snaps[t] >= 0]
        seen = {}
        for b, slot, arg in writes:
            if slot in seen:
                raise ValueError(f"{op}: {arg}: got slot {slot}; expected a slot written once "
                                 f"(also {seen[slot]})")
            seen[slot] = arg
        check_write_conflicts(op, reads, writes)
    torch.ops.ssm_spec.gdn_snapshot_verify(q, k, v, g, beta, state, src_indices, query_start_loc,
                                           snapshot_indices, out, scale, use_qk_l2norm)
    return out
