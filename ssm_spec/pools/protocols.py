"""The state protocols a :class:`~ssm_spec.StatePool` runs (docs/design.md sections 1, 2.6, 5.6, 5.7).

One object per pool mode owns what differs between them: which op a GDN layer's verify calls,
what the conv does after its verify, what :func:`ssm_spec.commit` writes, and how pending
windows are flushed or dropped. The modules, the commit and the pool ask the pool's protocol
instead of testing flags:

======== ========================================== =========================================
protocol verify                                     commit
======== ========================================== =========================================
exact    ``gdn_verify`` (token loop, records)       ``gdn_commit`` replays the accepted tokens
snapshot ``gdn_snapshot_verify`` (state per token)  copies the accepted token's snapshot back
folded   ``gdn_folded_verify`` (last step's commit  notes the accepted counts; the next verify
         on the way, then the window)               commits them
fast     ``gdn_closed_form_verify`` (closed form)   ``gdn_commit`` replays its records
lazy     ``gdn_closed_form_folded_verify`` (folds   adds the accepted tokens to each slot's
         pending ring records past ``max_pending``) pending ring records
======== ========================================== =========================================

The conv states commit at once in every protocol but the snapshot one, which writes them per
token at verify and copies them back like the GDN states.
"""

from __future__ import annotations

import torch

from ..ops import NULL_SLOT, _eager
from ..ops._validate import count_values, window_bounds

__all__ = ["MODES", "STATE_DTYPES", "Protocol", "Exact", "Snapshot", "Folded", "Fast", "Lazy", "make_protocol",
           "plan_commit", "check_mode", "check_state_dtype"]

#: The verify modes (docs/design.md section 2.6): ``"exact"`` (the token loop, bit-identical to the
#: native recurrence; the default) and ``"fast"`` (the closed-form window, within a stated error
#: bound, and with a folded pool the lazy commit).
MODES = ("exact", "fast")
#: Recurrent state dtypes a pool holds.
STATE_DTYPES = (torch.float32, torch.bfloat16)


def check_mode(caller: str, value) -> str:
    """``value`` if it is one of :data:`MODES`.

    Raises:
        ValueError: naming ``caller`` and the argument, otherwise.
    """
    if value not in MODES:
        raise ValueError(f"{caller}: mode: got {value!r}; expected one of {MODES}")
    return value


def check_state_dtype(caller: str, value) -> torch.dtype:
    """``value`` if it is one of :data:`STATE_DTYPES`.

    Raises:
        ValueError: naming ``caller`` and the argument, otherwise.
    """
    if value not in STATE_DTYPES:
        raise ValueError(f"{caller}: state_dtype: got {value}; expected torch.float32 or torch.bfloat16")
    return value


def plan_commit(metadata, num_accepted_tokens: torch.Tensor):
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


def _empty_window_inputs(spec, device):
    """``(q [0, H, K], v [0, HV, V], per-head [0, HV])`` for a launch with empty windows (a flush)."""
    empty = torch.empty(0, device=device)
    return (empty.reshape(0, spec.num_k_heads, spec.head_k_dim), empty.reshape(0, spec.num_v_heads, spec.head_v_dim),
            empty.reshape(0, spec.num_v_heads))


class Protocol:
    """What one pool mode does at verify, commit, flush and discard (the base: the exact token
    loop, which :class:`Exact` names). Stateless: the pool holds the tensors.

    Attributes:
        name: the protocol's name (``"exact"``, ``"snapshot"``, ``"folded"``, ``"fast"``, ``"lazy"``).
        snapshot: verify writes a state per window token into scratch slots.
        folded: slots keep pending windows between steps (:meth:`flush` / :meth:`discard` apply).
        ring: pending tokens live in per-slot record rings (the lazy commit).
        double_buffered: the step records alternate between two buffers across steps.
    """

    name = "exact"
    snapshot = False
    folded = False
    ring = False
    double_buffered = False
    verify_op = "gdn_verify"

    # ------------------------------------------------------------------ verify
    def plan(self, pool, metadata, device, layer):
        """Called by each GDN layer before it writes anything: what its verify needs beside the
        step's inputs (``None`` here). May refuse the step (``ValueError``)."""
        return None

    def verify(self, pool, layer, args, out, metadata, plan, scale: float) -> None:
        """Run a GDN layer's verify over the step's verify span: ``args`` are ``(q, k, v, g,
        beta, state, verify_indices, verify_query_start_loc)`` on the span, ``out`` the span's
        output rows."""
        rec = pool.gdn_record(layer, out.shape[0])
        _eager.call(self.verify_op, *args, out, rec.u, rec.k, rec.decay, *self._verify_extra(metadata), scale, True)

    def _verify_extra(self, metadata) -> tuple:
        return ()

    def conv_verified(self, pool, conv_state, rec_x, metadata) -> None:
        """After a conv layer's verify (the recorded inputs in ``rec_x``): nothing to write."""

    # ------------------------------------------------------------------ commit
    def check_commit(self, pool, metadata, counts) -> object:
        """The commit's host-side checks with validation on (``counts``: the validated counts);
        returns what :meth:`commit` needs of them (``None`` here).

        Raises:
            ValueError: the step cannot be committed under this protocol (nothing written).
        """
        return None

    def commit(self, pool, metadata, n: torch.Tensor, checked) -> None:
        """Commit a step with verify rows: ``n [B]`` int32 accepted counts on ``pool.device``."""
        self._commit_records(pool, metadata, n, gdn=True)

    @staticmethod
    def _commit_records(pool, metadata, n, gdn: bool) -> None:
        """Replay the accepted tokens' records into the states: one grouped ``gdn_commit`` per GDN
        group (when ``gdn``) and one ``short_conv_commit`` per conv group, each on its device."""
        src, dst, bidx, boff = plan_commit(metadata, n)
        T = metadata.verify_stop - metadata.verify_start  # records cover the verify span only
        on = pool.per_device(metadata.verify_query_start_loc, src, n, dst, bidx, boff)
        if gdn:
            for (device, _), (state, records) in pool.gdn_groups.items():
                pool.launch(device, "gdn_commit", state, *(r[:, :T] for r in records), *on[device])
        for (device, _), (state, rec_x) in pool.conv_groups.items():
            pool.launch(device, "short_conv_commit", state, rec_x[:, :T], *on[device])

    # ------------------------------------------------------------------ pending windows
    def flush(self, pool, slots) -> None:
        raise ValueError("StatePool.flush: only a folded pool (StatePool(folded=True)) has pending windows")

    def discard(self, pool, slots) -> None:
        raise ValueError("StatePool.discard: only a folded pool (StatePool(folded=True)) has pending windows")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Exact(Protocol):
    """RecoverSSM's default: the token loop's verify records, commit replays them."""


class Fast(Protocol):
    """The closed-form verify (docs/design.md section 2.6); commit replays its records."""

    name = "fast"
    verify_op = "gdn_closed_form_verify"

    def _verify_extra(self, metadata) -> tuple:
        return (metadata.max_window,)


class Snapshot(Protocol):
    """The native per-draft protocol: a state per window token, the accepted one copied back."""

    name = "snapshot"
    snapshot = True

    def verify(self, pool, layer, args, out, metadata, plan, scale: float) -> None:
        slots = pool.snapshot_slots(out.shape[0], args[5].device)
        _eager.call("gdn_snapshot_verify", *args, slots, out, scale, True)

    def conv_verified(self, pool, conv_state, rec_x, metadata) -> None:
        """Write the conv state after every window token into the token's scratch slot."""
        qsl = metadata.verify_query_start_loc
        bos, lens = qsl[:-1], qsl[1:] - qsl[:-1]
        j = torch.arange(metadata.max_window, dtype=torch.int32, device=qsl.device)[None, :]
        idx = torch.where(j < lens[:, None], pool.num_slots + bos[:, None] + j, torch.full_like(j, -1))
        offsets = (j + 1).expand_as(idx).to(torch.int32).contiguous()
        none = torch.full_like(lens, -1, dtype=torch.int32)
        _eager.call("short_conv_commit", conv_state, rec_x, qsl, metadata.verify_indices, lens.to(torch.int32),
                    none, idx.to(torch.int32), offsets)

    def check_commit(self, pool, metadata, counts):
        if metadata.align:
            raise ValueError("commit: snapshot mode supports no align mode (no block tables)")
        return None

    def commit(self, pool, metadata, n, checked) -> None:
        """Copy the snapshot of each row's last accepted token into its slot (rows accepting
        nothing, prefill and padding rows copy the dummy slot onto itself)."""
        if metadata.align:
            raise ValueError("commit: snapshot mode supports no align mode (no block tables)")
        src = metadata.verify_indices.long()
        n = n.long()
        take = (src >= 0) & (n > 0)
        dummy = torch.full_like(src, pool.dummy_slot)
        scratch = torch.where(take, pool.num_slots + metadata.verify_query_start_loc[:-1].long() + n - 1, dummy)
        target = torch.where(take, src, dummy)
        on = pool.per_device(target, scratch)
        for (device, _), (state, _) in (*pool.gdn_groups.items(), *pool.conv_groups.items()):
            d_target, d_scratch = on[device]
            state.index_copy_(1, d_target, state.index_select(1, d_scratch))


class Folded(Protocol):
    """The folded commit (docs/design.md section 5.7): commit notes each row's accepted count,
    the next step's ``gdn_folded_verify`` replays it on the way (one state read and one write
    per step); the records are double-buffered."""

    name = "folded"
    folded = True
    double_buffered = True

    def plan(self, pool, metadata, device, layer):
        if metadata.align:
            raise ValueError("RecoverGatedDeltaNet: a folded pool (StatePool(folded=True)) supports no align mode")
        return self._pending_plan(pool.pending, metadata, device, layer)

    @staticmethod
    def _pending_plan(pending, metadata, device, layer):
        """What this step's verify folds in on the way (the previous step's accepted windows)."""
        return pending.fold_plan(metadata, device, layer)

    def verify(self, pool, layer, args, out, metadata, plan, scale: float) -> None:
        rec = pool.gdn_record(layer, out.shape[0])
        _eager.call("gdn_folded_verify", *args, out, rec.u, rec.k, rec.decay, *pool.gdn_prev_record(layer), *plan,
                    scale, True)

    def check_commit(self, pool, metadata, counts):
        if metadata.align:
            raise ValueError("commit: a folded pool (StatePool(folded=True)) supports no align mode")
        slots = metadata.verify_indices.tolist()
        pool.pending.check_pending_verified(slots)
        return slots, counts

    def commit(self, pool, metadata, n, checked) -> None:
        pool.pending.note_pending(metadata, n, checked)
        self._commit_records(pool, metadata, n, gdn=False)

    @torch.no_grad()
    def flush(self, pool, slots) -> None:
        pending = pool.pending
        B = slots.numel()
        idx = slots.long()
        start, count = pending.pending_start[idx], pending.pending_count[idx]
        qsl = torch.zeros(B + 1, dtype=torch.int32, device=pool.device)  # empty windows: fold only
        on = pool.per_device(slots, qsl, start, count)  # each group launches on its own device
        for (dev, spec), g in pool.gdn_group_items():
            d_slots, d_qsl, d_start, d_count = on[dev]
            q, v, per_head = _empty_window_inputs(spec, dev)
            for layer in range(len(g.members)):
                prev = [r[layer] for r in g.prev_records]
                pool.launch(dev, "gdn_folded_verify", q, q, v, per_head, per_head, g.state[layer], d_slots, d_qsl, v,
                            v.clone(), q.clone(), per_head.clone(), *prev, d_start, d_count,
                            spec.head_k_dim ** -0.5, True)
        pending.pending_count.index_fill_(0, idx, 0)
        if pending._pending_host is not None:
            pending._pending_host -= set(slots.tolist())

    def discard(self, pool, slots) -> None:
        pool.pending.discard(slots)


class Lazy(Folded):
    """Fast folded mode, the lazy commit (docs/design.md section 2.6): each slot keeps its
    accepted tokens as records in a per-slot ring, and ``gdn_closed_form_folded_verify`` folds
    them into the state only when they would pass ``max_pending``."""

    name = "lazy"
    ring = True
    double_buffered = False

    @staticmethod
    def _pending_plan(pending, metadata, device, layer):
        """The rings' plan: what each slot keeps pending and what it folds in at this step."""
        return pending.lazy_plan(metadata, device, layer)

    def verify(self, pool, layer, args, out, metadata, plan, scale: float) -> None:
        _eager.call("gdn_closed_form_folded_verify", *args, out, *pool.gdn_ring(layer), *plan, metadata.max_window,
                    pool.max_pending, scale, True)

    def check_commit(self, pool, metadata, counts):
        if metadata.align:
            raise ValueError("commit: a folded pool (StatePool(folded=True)) supports no align mode")
        return None

    def commit(self, pool, metadata, n, checked) -> None:
        pool.pending.note_accepted(metadata, n)
        self._commit_records(pool, metadata, n, gdn=False)

    @torch.no_grad()
    def flush(self, pool, slots) -> None:
        """Fold every pending token of ``slots``: the lazy kernel with empty windows and
        ``max_pending`` 0, launched with the pool's ``max_window`` (the windows are empty either
        way: the pending block ``next_pow2(R - max_window)`` is then the tightest that holds
        every valid count, and a step whose window is the pool's longest compiled that binary)."""
        pending = pool.pending
        B = slots.numel()
        idx = slots.long()
        start, count = pending.pending_start[idx], pending.pending_count[idx]
        qsl = torch.zeros(B + 1, dtype=torch.int32, device=pool.device)
        on = pool.per_device(slots, qsl, start, count)
        for (dev, spec), g in pool.gdn_group_items():
            d_slots, d_qsl, d_start, d_count = on[dev]
            q, v, per_head = _empty_window_inputs(spec, dev)
            for layer in range(len(g.members)):
                pool.launch(dev, "gdn_closed_form_folded_verify", q, q, v, per_head, per_head, g.state[layer], d_slots,
                            d_qsl, v, *(r[layer] for r in g.ring), d_start, d_count, pool.max_window, 0,
                            spec.head_k_dim ** -0.5, True)
        pending.pending_start.index_copy_(0, idx, (start + count) % pool.ring_positions)
        pending.pending_count.index_fill_(0, idx, 0)


def make_protocol(*, snapshot: bool, folded: bool, mode: str, max_pending: int) -> Protocol:
    """The protocol of a pool built with these switches (:class:`~ssm_spec.StatePool`'s).

    Raises:
        ValueError: ``snapshot`` with ``folded`` or with ``mode="fast"``; an unknown ``mode``;
            ``max_pending`` not an int >= 1, or above 1 without ``mode="fast"`` and ``folded``.
    """
    if snapshot and folded:
        raise ValueError("StatePool: snapshot and folded are two different protocols; choose one")
    check_mode("StatePool", mode)
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise ValueError(f"StatePool: max_pending: got {max_pending!r}; expected an int >= 1")
    if max_pending > 1 and not (mode == "fast" and folded):
        raise ValueError("StatePool: max_pending > 1 (the lazy commit) needs mode='fast' and folded=True")
    if mode == "fast" and snapshot:
        raise ValueError("StatePool: snapshot is the native protocol; mode='fast' is a RecoverSSM mode")
    if snapshot:
        return Snapshot()
    if folded:
        return Lazy() if mode == "fast" else Folded()
    return Fast() if mode == "fast" else Exact()


def validate_commit(pool, metadata, num_accepted_tokens) -> object:
    """The commit's host checks (shape, counts within their windows, the protocol's own);
    returns what the protocol's commit needs of them.

    Raises:
        ValueError: a check fails (nothing written).
    """
    if num_accepted_tokens.shape != (metadata.num_rows,):
        raise ValueError(f"commit: num_accepted_tokens: got shape {list(num_accepted_tokens.shape)}; "
                         f"expected [{metadata.num_rows}]")
    counts = count_values("commit", num_accepted_tokens, window_bounds("commit", metadata.query_start_loc,
                                                                       metadata.num_tokens))
    if not metadata.has_verify:
        return None
    return pool.protocol.check_commit(pool, metadata, counts)
