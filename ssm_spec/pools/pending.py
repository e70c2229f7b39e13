"""The folded pools' pending-window bookkeeping (docs/design.md sections 5.7 and 2.6).

Per slot a folded pool keeps, on the device, where its pending tokens start (in the previous
step's records, or in the slot's record ring) and how many there are; each step's first layer
takes a plan from it (which rows fold what) and :func:`ssm_spec.commit` hands the accepted
counts back. Nothing here synchronises with the device, except the host mirror that validating
(eager) commits keep to catch a step that skips a pending slot.
"""

from __future__ import annotations

import torch

from .._backref import BackRef

__all__ = ["PendingWindows", "slot_tensor"]


def slot_tensor(op: str, slots, num_slots: int, device) -> torch.Tensor:
    """``slots`` (ints, a list of them or an integer tensor) as an int32 tensor on ``device``.

    Raises:
        ValueError: not integers, or a slot outside ``0..num_slots - 1``.
    """
    t = torch.as_tensor(slots)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{op}: slots: got {slots!r}; expected slot numbers (ints)")
    t = t.to(device=device, dtype=torch.int32).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_slots):
        raise ValueError(f"{op}: slots: got {t.tolist()}; expected 0..{num_slots - 1}")
    return t


class PendingWindows:
    """Each slot's pending tokens in a folded :class:`~ssm_spec.StatePool`, and the step plans.

    Attributes:
        pending_start / pending_count: ``[num_slots + 1]`` int32 on the pool's device (entry
            ``num_slots`` is a sink for padding rows and holds nothing).
    """

    def __init__(self, pool):
        self._pool = BackRef(pool)  # the pool holds this object: no cycle back
        self.device = pool.device
        self.num_slots = pool.num_slots
        self.pending_start = torch.zeros(self.num_slots + 1, dtype=torch.int32, device=self.device)
        self.pending_count = torch.zeros(self.num_slots + 1, dtype=torch.int32, device=self.device)
        self._pending_host: set[int] | None = set()  # host mirror while commits validate
        self._plan: tuple | None = None  # (metadata, plan on self.device, {other device: copy of the plan})
        self._plan_layers: set[int] = set()  # the layers that took the current plan (ids)

    @property
    def pool(self):
        """The :class:`~ssm_spec.StatePool` this bookkeeping belongs to (``None`` once it is gone)."""
        return self._pool()

    def fold_plan(self, metadata, device=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Folded mode: ``(prev_start [B], prev_num_accepted_tokens [B])`` int32 for the step's
        verify rows (0 for padding and prefill rows), computed on :attr:`device` once per step
        (the layers call it before they write anything) and returned on ``device`` (default
        :attr:`device`; a layer on another device gets a copy, made once per step and device).

        The step is recognised by its metadata object: every layer of a step must pass the same
        one (``layer``: the calling layer, so that a second metadata object within one step,
        such as a per-device copy, is refused instead of redoing the plan from cleared counts).

        Taking the plan hands the verified rows' pending windows to this step: their counts are
        cleared at once, so a :meth:`flush` before the step's commit cannot commit them twice.
        A fresh request's slot (a verify row with ``num_computed_tokens == 0``, or a prefill row
        from the zero state) drops whatever window a finished request left pending there.

        Raises:
            ValueError: a prefill row continuing from a slot with a pending window (flush it
                first); detected while the host mirror is known, i.e. while commits validate.
                A ``layer`` that has not taken this step's plan passing another metadata object
                (:meth:`_check_step`). Raised before anything is written.
        """
        if self._plan is not None:
            if self._plan[0] is metadata:
                return self._plan_on(device, layer)
            self._check_step(layer)
        if self._pending_host:
            for row in metadata.prefill_rows:
                if row.src >= 0 and row.src in self._pending_host:
                    raise ValueError(f"StatePool: slot {row.src} has a pending window (folded mode) and a prefill "
                                     f"row of this step continues from it; flush it first "
                                     f"(pool.flush([{row.src}]))")
        idx = self._release_fresh(metadata)
        if not metadata.has_verify:
            return self._plan_on(device, layer)
        plan = (self.pending_start[idx], self.pending_count[idx])  # gathered copies
        self.pending_count.index_fill_(0, idx, 0)  # handed to this step's verify
        self._set_plan(metadata, plan)
        return self._plan_on(device, layer)

    def _set_plan(self, metadata, plan) -> None:
        self._plan = (metadata, plan, {})
        self._plan_layers = set()

    def _check_step(self, layer) -> None:
        """A plan is asked for with another metadata object than the current plan's: a new step,
        unless ``layer`` has not taken the current plan yet (then it is the same step, and a
        second plan would start from the counts the first one cleared: the pending windows
        would be lost). Host-side only (a set lookup); ``layer=None`` checks nothing."""
        if layer is not None and id(layer) not in self._plan_layers:
            raise ValueError(f"StatePool: {type(layer).__name__} got another metadata object than the layers before "
                             "it in this step (a folded pool recognises a step by its metadata object): pass the "
                             "same RecoverSSMMetadata, built on pool.device, to every layer of a step (layers on "
                             "other devices copy it themselves)")

    def _plan_on(self, device, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The current step's plan on ``device`` (``layer`` takes it): the plan itself on
        :attr:`device`, else a copy made at the first call for that device."""
        if layer is not None:
            self._plan_layers.add(id(layer))
        _, plan, copies = self._plan
        if device is None or device == self.device:
            return plan
        got = copies.get(device)
        if got is None:
            got = copies[device] = tuple(t.to(device) for t in plan)
        return got

    def lazy_plan(self, metadata, device=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fast folded mode: ``(pending_start [B], pending_count [B])`` int32 of the step's verify
        rows (0 for padding and prefill rows), for the layers' ``gdn_closed_form_folded_verify``;
        computed on :attr:`device` once per step (the first layer calls it, before anything is
        written) and returned on ``device`` as :meth:`fold_plan` does. It also moves each slot's
        bookkeeping past this step's verify: a row that folds (``count > 0`` and ``count + W >
        max_pending``) has consumed its pending tokens (its ring now starts after them, count
        0); :func:`ssm_spec.commit` then adds the accepted tokens, whose records the verify wrote
        right after the pending ones.

        A prefill row continuing from a slot flushes that slot first (the prefill reads its
        state); a fresh request's slot drops whatever a finished request left pending there.
        Every layer of a step passes the same metadata object, as for :meth:`fold_plan`.

        Raises:
            ValueError: a verify window longer than the pool's ``max_window``; a ``layer`` that
                has not taken this step's plan passing another metadata object.
        """
        if self._plan is not None:
            if self._plan[0] is metadata:
                return self._plan_on(device, layer)
            self._check_step(layer)
        if metadata.max_window > self.pool.max_window:
            raise ValueError(f"StatePool: a verify window of {metadata.max_window} tokens; this fast folded pool's "
                             f"rings hold windows up to max_window={self.pool.max_window}")
        cont = sorted({row.src for row in metadata.prefill_rows if row.src >= 0})
        if cont:
            self.pool.flush(cont)
        idx = self._release_fresh(metadata)
        if not metadata.has_verify:
            return self._plan_on(device, layer)
        start, count = self.pending_start[idx], self.pending_count[idx]  # gathered copies
        qsl = metadata.to(self.device).verify_query_start_loc
        W = (qsl[1:] - qsl[:-1]).to(torch.int32)
        fold = (count > 0) & (count + W > self.pool.max_pending)
        self.pending_start.index_copy_(0, idx, torch.where(fold, (start + count) % self.pool.ring_positions, start))
        self.pending_count.index_copy_(0, idx, torch.where(fold, torch.zeros_like(count), count))
        self.pending_start[self.num_slots:].zero_()  # the sink holds nothing
        self.pending_count[self.num_slots:].zero_()
        self._set_plan(metadata, (start, count))
        return self._plan_on(device, layer)

    def note_accepted(self, metadata, num_accepted_tokens: torch.Tensor) -> None:
        """Fast folded mode (called by :func:`ssm_spec.commit`): each verify row's accepted
        tokens join its slot's pending ones (no state written, no host sync)."""
        idx = self._sink(metadata.verify_indices)
        self.pending_count.index_add_(0, idx, num_accepted_tokens.to(device=self.device, dtype=torch.int32))
        self.pending_count[self.num_slots:].zero_()
        self._plan = None

    def _release_fresh(self, metadata) -> torch.Tensor:
        """Both folded plans' common start: a fresh request's slot (a prefill row from the zero
        state, a verify row with ``num_computed_tokens == 0``) drops what a finished request left
        pending there. Returns the verify rows' slots (padding rows: the sink). When every verify
        window is empty no kernel runs, so nothing is handed over: the plan (cached) is zeros."""
        fresh = [row.dst for row in metadata.prefill_rows if row.src < 0]
        if fresh:
            self.discard(fresh)
        if metadata.fresh_slots.numel():
            self.pending_count.index_fill_(0, metadata.fresh_slots.to(device=self.device, dtype=torch.long), 0)
        idx = self._sink(metadata.verify_indices)
        if not metadata.has_verify:
            zeros = torch.zeros_like(idx, dtype=torch.int32)
            self._set_plan(metadata, (zeros, zeros.clone()))
        return idx

    def _sink(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(device=self.device, dtype=torch.long)
        return torch.where(slots >= 0, slots, torch.full_like(slots, self.num_slots)).clamp_max(self.num_slots)

    def note_pending(self, metadata, num_accepted_tokens: torch.Tensor, host_counts=None) -> None:
        """Folded mode (called by :func:`ssm_spec.commit`): each verify row's window becomes its
        slot's pending window with its accepted count, then the record buffers swap. No host
        sync; ``host_counts`` (the validated counts) keeps the host mirror."""
        idx = self._sink(metadata.verify_indices)
        self.pending_start.index_copy_(0, idx, metadata.to(self.device).verify_query_start_loc[:-1].to(torch.int32))
        self.pending_count.index_copy_(0, idx, num_accepted_tokens.to(device=self.device, dtype=torch.int32))
        self.pending_count[self.num_slots:].zero_()  # the sink holds nothing
        if host_counts is None or self._pending_host is None:
            self._pending_host = None  # unknown from here on: no host-side checks
        else:
            slots, counts = host_counts
            self._pending_host = {s for s, n in zip(slots, counts) if s >= 0 and n > 0}
        self._plan = None
        self.pool.swap_records()

    def check_pending_verified(self, verify_slots: list[int]) -> None:
        """Folded mode, commit-time check (host mirror known): every slot pending from the last
        step was verified in this one (its window got folded); otherwise its records would be
        overwritten by the next step.

        Raises:
            ValueError: a pending slot this step did not verify (nothing written; flush it, then
                commit again).
        """
        if self._pending_host:
            missing = sorted(self._pending_host - set(verify_slots))
            if missing:
                raise ValueError(f"commit: slots {missing} have pending windows (folded mode) that this step "
                                 f"did not verify; flush them first (pool.flush({missing})), then commit")


    def discard(self, slots=None) -> None:
        """The bookkeeping of :meth:`ssm_spec.StatePool.discard` (its docstring says what and when):
        the pending counts of ``slots`` (default: all) drop to zero, except the slots of a step in
        flight in ring mode.

        Raises:
            ValueError: slots that are not ints or lie outside ``0..num_slots - 1``.
        """
        if slots is None:
            slots = torch.arange(self.num_slots, device=self.device)
        idx = slot_tensor("StatePool.discard", slots, self.num_slots, self.device).long()
        if self.pool.ring_mode and self._plan is not None:  # a step in flight: the slots it verified keep the
            # tokens their verify used (as the exact folded pool's verify took its window over)
            busy = set(self._plan[0].verify_indices.tolist())
            idx = torch.tensor([s for s in idx.tolist() if s not in busy], dtype=torch.long, device=self.device)
        if self.pool.ring_mode:  # the ring moves past the dropped tokens: a window verified this step (records
            # right after them) is what the commit's accepted tokens point at
            self.pending_start.index_copy_(0, idx, (self.pending_start[idx] + self.pending_count[idx])
                                           % self.pool.ring_positions)
        self.pending_count.index_fill_(0, idx, 0)
        if self._pending_host is not None:
            self._pending_host -= set(idx.tolist())
