"""``commit``: after sampling, commit every verify row of every layer in one launch per group
(a group: the layers of one state shape on one device).

The plan (source, destination and boundary slots per row) is computed on the device from the
step's metadata and the accepted counts, so, with validation off (``validate=False``, as in
captured and compiled steps), no host sync sits between sampling and commit on a pool on one
device or spread over GPUs only (docs/design.md section 5.5). A pool with groups on a GPU and on
the CPU copies the plan to the CPU for the CPU's groups: that device-to-host copy waits for the
GPU's sampling, as every such copy does (section 5.9). Validation (the eager default) reads the
counts back on the host.
"""

from __future__ import annotations

import torch

from .metadata import RecoverSSMMetadata
from .ops import NULL_SLOT
from .ops._validate import count_values, should_validate, window_bounds
from .pools import StatePool

__all__ = ["commit", "plan_commit"]


def plan_commit(metadata: RecoverSSMMetadata, num_accepted_tokens: torch.Tensor):
    """``(src, dst, boundary_indices, boundary_offsets)`` int32 device tensors for the commit.

    Without align mode every verify row commits in place (``dst = src``) with no boundaries.
    In align mode (docs/design.md section 5.8) the final state goes to the block of the last
    accepted token, column ``(num_computed + n - 1) // block_size``, and every boundary
    ``p`` crossed (``1 <= (p + 1) * block_size - num_computed <= n``) gets its state; a column
    past the table is skipped (validation rejected it when the metadata was built).
    """
    src = metadata.verify_indices
    B = metadata.num_rows
    n = num_accepted_tokens.to(torch.int32)
    if not metadata.align:
        empty = torch.empty((B, 0), dtype=torch.int32, device=src.device)
        return src, src, empty, empty
    bs = metadata.block_size
    table = metadata.block_table
    ncols = table.shape[1]
    nc = metadata.num_computed_tokens
    last = (nc + n - 1).clamp_min(0) // bs
    dst = table.gather(1, last.clamp_max(max(ncols - 1, 0)).long()[:, None])[:, 0]
    dst = torch.where((n > 0) & (last < ncols), dst, torch.full_like(dst, NULL_SLOT))
    nbd = metadata.max_window // bs + 1
    col = (nc // bs)[:, None] + torch.arange(nbd, dtype=torch.int32, device=src.device)[None, :]
    offsets = (col + 1) * bs - nc[:, None]
    bidx = table.gather(1, col.clamp_max(max(ncols - 1, 0)).long())
    bidx = torch.where(col < ncols, bidx, torch.full_like(bidx, NULL_SLOT))
    return src, dst.to(torch.int32), bidx.to(torch.int32), offsets.to(torch.int32)


def _commit_snapshots(pool: StatePool, metadata: RecoverSSMMetadata, num_accepted_tokens):
    """The native protocol's commit: copy the snapshot of each row's last accepted token into
    its slot (rows accepting nothing, prefill and padding rows copy the dummy slot onto
    itself)."""
    if metadata.align:
        raise ValueError("commit: snapshot mode supports no align mode (no block tables)")
    src = metadata.verify_indices.long()
    n = num_accepted_tokens.long()
    take = (src >= 0) & (n > 0)
    dummy = torch.full_like(src, pool.dummy_slot)
    scratch = torch.where(take, pool.num_slots + metadata.verify_query_start_loc[:-1].long() + n - 1, dummy)
    target = torch.where(take, src, dummy)
    on = pool.per_device(target, scratch)
    for (device, _), (state, _) in (*pool.gdn_groups.items(), *pool.conv_groups.items()):
        d_target, d_scratch = on[device]
        state.index_copy_(1, d_target, state.index_select(1, d_scratch))


def commit(pool: StatePool, metadata: RecoverSSMMetadata, num_accepted_tokens: torch.Tensor,
           validate: bool | None = None) -> None:
    """Commit the accepted tokens of every verify row into every layer's states.

    One grouped ``gdn_commit`` launch per GDN state group and one ``short_conv_commit`` per
    conv shape group, each on its group's device; prefill and padding rows take no part. With a
    folded pool (``StatePool(folded=True)``) the GDN states are not written here: each row's count is
    noted on the device and the next step's verify commits it (see :class:`~ssm_spec.StatePool`);
    in fast mode (``mode="fast"``) the records replayed are the closed-form verify's, and a fast
    folded pool keeps the accepted tokens pending in its rings (the lazy commit).

    Args:
        pool: the :class:`~ssm_spec.StatePool` the step's layers verified against.
        metadata: the step's :class:`~ssm_spec.RecoverSSMMetadata` (the same object the layers
            got), on ``pool.device``.
        num_accepted_tokens: ``[B]`` int32 on the device (a pool spread over devices: on
            ``pool.device``; the plan is copied once to each other device), ``0 <= n[b] <=
            window length`` (``0``: a discarded step, nothing written).
        validate: check the counts on the host (``None``: in eager mode only).

    Raises:
        ValueError: with validation on, a ``num_accepted_tokens`` not of shape ``[B]`` or a count
            outside its window; snapshot mode with align mode; a folded pool with align mode or
            with a slot whose pending window this step did not verify. Nothing is written.
    """
    host_counts = None
    if should_validate(validate, "commit"):
        if num_accepted_tokens.shape != (metadata.num_rows,):
            raise ValueError(f"commit: num_accepted_tokens: got shape {list(num_accepted_tokens.shape)}; "
                             f"expected [{metadata.num_rows}]")
        counts = count_values("commit", num_accepted_tokens, window_bounds("commit", metadata.query_start_loc,
                                                                           metadata.num_tokens))
        if pool.folded and metadata.has_verify:
            if metadata.align:
                raise ValueError("commit: a folded pool (StatePool(folded=True)) supports no align mode")
        if pool.double_buffered and metadata.has_verify:
            slots = metadata.verify_indices.tolist()
            pool.check_pending_verified(slots)
            host_counts = (slots, counts)
    if not metadata.has_verify:
        return
    if pool.snapshot:
        _commit_snapshots(pool, metadata, num_accepted_tokens)
        return
    src, dst, bidx, boff = plan_commit(metadata, num_accepted_tokens)
    n = num_accepted_tokens.to(torch.int32)
    T = metadata.verify_stop - metadata.verify_start  # records cover the verify span only
    qsl = metadata.verify_query_start_loc
    if pool.ring_mode:  # fast folded: the accepted tokens stay pending in the slots' rings
        pool.note_accepted(metadata, n)
    elif pool.folded:  # the next step's verify commits the GDN states (gdn_folded_verify)
        pool.note_pending(metadata, n, host_counts)
    # the plan on each group's device: the tensors themselves on a pool on one device
    on = pool.per_device(qsl, src, n, dst, bidx, boff)
    if not pool.folded:  # each launch on its group's device (pool.launch: as it is on a pool on one device)
        for (device, _), (state, records) in pool.gdn_groups.items():
            pool.launch(device, "gdn_commit", state, *(r[:, :T] for r in records), *on[device])
    for (device, _), (state, rec_x) in pool.conv_groups.items():
        pool.launch(device, "short_conv_commit", state, rec_x[:, :T], *on[device])
