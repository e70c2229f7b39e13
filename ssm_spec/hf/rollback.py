"""``RollbackPool``: the states of B sequences with their last tokens kept pending.

transformers' assisted generation and prompt lookup run a forward over the last token plus
the drafts, then ``crop`` the cache back by the rejected drafts; an assistant's crops can span
several forwards, and the first forward carries the prompt and the first drafts at once
(docs/design.md section 7.3). RecoverSSM serves this by holding, for each sequence, a **checkpoint**
slot and the replay records of the tokens after it (the pending tokens):

* a forward verifies its tokens from the state after the pending tokens (the checkpoint, or a
  scratch slot holding checkpoint + pending, kept current by commits with ``dst != src``),
  so the checkpoint is never written by a verify;
* ``crop(m)`` replays all pending tokens but the last ``m`` into the checkpoint (one grouped
  commit launch per state group) and leaves nothing pending;
* at most ``max_pending`` tokens stay pending between forwards: older ones are committed when
  the next forward begins; a forward longer than ``max_pending`` (a prompt, a follow-up
  message) commits what is pending, runs the chunked prefill over all but its last
  ``max_pending`` tokens and verifies those.

A model spread over devices (a ``device_map``) gets a pool whose groups sit on the layers'
devices: every commit launch runs on its group's device, with slot tensors made once per device
and each forward's metadata copied once per device and plan.

Every count is a host integer that transformers already holds (window lengths, crop sizes),
so nothing here synchronises with the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..metadata import RecoverSSMMetadata
from ..pools import StatePool

__all__ = ["RollbackPool"]


@dataclass
class _Plan:
    """One forward: ``prefill_len`` tokens per row prefilled into the checkpoint, then the
    remaining ``verify_len`` tokens verified (records kept pending)."""

    prefill_len: int
    verify_len: int
    prefill: RecoverSSMMetadata | None
    verify: RecoverSSMMetadata | None


class RollbackPool:
    """A :class:`~ssm_spec.StatePool` for ``batch_size`` sequences that can drop its last tokens.

    Slots: row ``b``'s checkpoint is slot ``b``; slot ``batch_size + b`` is its scratch slot.

    Args:
        layers: the :class:`~ssm_spec.RecoverGatedDeltaNet` / :class:`~ssm_spec.RecoverShortConv`
            modules, in model order.
        batch_size: rows (sequences); every forward carries the same number of tokens per row.
        max_pending: tokens kept pending between forwards (``>= 1``): the deepest crop that
            must succeed after a forward without crops since.
        dtype / conv_dtype / device / mode: as :class:`~ssm_spec.StatePool` (``device``: one
            device, or one per layer; ``mode="fast"``: the closed-form verify, its records
            replay as the exact ones do).

    Raises:
        ValueError: ``batch_size < 1`` or ``max_pending < 1``; from :meth:`run`, hidden states
            on another device than the layer's states (a pool on several devices).
    """

    def __init__(self, layers, batch_size: int, max_pending: int, *, dtype=torch.float32, conv_dtype=None,
                 device=None, mode: str = "exact"):
        if batch_size < 1 or max_pending < 1:
            raise ValueError(f"RollbackPool: batch_size={batch_size}, max_pending={max_pending}; expected >= 1")
        self.layers = list(layers)
        self.batch_size = int(batch_size)
        self.max_pending = int(max_pending)
        self._pool_kwargs = dict(dtype=dtype, conv_dtype=conv_dtype, device=device, mode=mode)
        self.pool = StatePool(self.layers, num_slots=2 * self.batch_size,
                              max_tokens=self.batch_size * self.max_pending, **self._pool_kwargs)
        self.device = self.pool.device  # where the forwards' metadata is built
        B = self.batch_size
        # per device, made once: (checkpoint slots, scratch slots, no boundaries)
        self._slots = {d: (torch.arange(B, dtype=torch.int32, device=d),
                           torch.arange(B, 2 * B, dtype=torch.int32, device=d),
                           torch.empty((B, 0), dtype=torch.int32, device=d)) for d in self.pool.devices}
        self.seen = 0  # tokens per row in the state, pending ones included
        self._pending = {}  # group key (device, spec) -> records [NL, B, p, ...] of the pending tokens
        self._pending_len = 0
        self._scratch_len = 0  # pending tokens already replayed into the scratch slots
        self._unabsorbed = 0  # tokens per row whose records still sit in the pool's buffers
        self._plan: _Plan | None = None
        self._metadata_cache: dict = {}
        self._counts: dict = {}

    # ------------------------------------------------------------------ queries
    @property
    def pending(self) -> int:
        """Tokens per row after the checkpoint whose records are held (croppable)."""
        return self._pending_len + self._unabsorbed

    @property
    def plan(self) -> _Plan:
        if self._plan is None:
            raise RuntimeError("RollbackPool: no forward has begun")
        return self._plan

    def reset(self) -> None:
        """Forget every token (the next forward starts a sequence); buffers, slots and the
        cached metadata stay, so CUDA graphs captured on them stay valid."""
        self.seen = 0
        self._pending.clear()
        self._pending_len = self._scratch_len = self._unabsorbed = 0
        self._plan = None

    # ------------------------------------------------------------------ forward
    def begin_forward(self, num_tokens: int) -> _Plan:
        """Plan a forward of ``num_tokens`` tokens per row (host ints only; launches at most one
        grouped commit per state group to retire old pending tokens and one to bring the
        scratch slots up to date)."""
        L = int(num_tokens)
        self._absorb()
        p = self._pending_len
        if L > self.max_pending:  # a prompt (or a long follow-up): prefill all but the last max_pending
            if p:
                self._commit_pending(p, into_checkpoint=True)
            verify_len = self.max_pending
        else:  # retire the oldest pending tokens beyond max_pending; verify the whole forward
            retire = min(p, max(0, p + L - self.max_pending))
            if retire:
                self._commit_pending(retire, into_checkpoint=True)
            verify_len = L
        prefill_len = L - verify_len
        read = self._bring_scratch_up_to_date()
        self._ensure_record_capacity(self.batch_size * verify_len)
        key = (prefill_len, verify_len, self.seen == 0, read)  # the metadata depends on nothing else
        plan = self._metadata_cache.get(key)
        if plan is None:
            plan = self._metadata_cache[key] = self._build_plan(prefill_len, verify_len, read)
        self._plan = plan
        self.seen += L
        self._unabsorbed = verify_len
        return plan

    def _build_plan(self, prefill_len, verify_len, read) -> _Plan:
        B, S = self.batch_size, 2 * self.batch_size
        fresh = self.seen == 0  # num_computed_tokens 0 zeroes the slot (no align mode: nothing else reads it)
        prefill = verify = None
        if prefill_len:
            prefill = RecoverSSMMetadata.build([prefill_len] * B, [True] * B, [0 if fresh else 1] * B, list(range(B)),
                                               num_slots=S, device=self.device)
        if verify_len:
            slots = list(range(B, 2 * B)) if read == "scratch" else list(range(B))
            nct = [0 if fresh and not prefill_len else 1] * B
            verify = RecoverSSMMetadata.build([verify_len] * B, [False] * B, nct, slots, num_slots=S,
                                              device=self.device)
        return _Plan(prefill_len, verify_len, prefill, verify)

    def run(self, layer, hidden: torch.Tensor) -> torch.Tensor:
        """Run ``layer`` over this forward's ``hidden [B, L, D]`` -> ``[B, L, D]``.

        Raises:
            ValueError: ``hidden`` of another shape than the forward planned, or of no tokens
                (``L == 0``), or on another device than the layer's states.
        """
        plan = self.plan
        B, L, D = hidden.shape
        if B != self.batch_size or L != plan.prefill_len + plan.verify_len:
            raise ValueError(f"RollbackPool.run: hidden: got [{B}, {L}, {D}]; the forward planned "
                             f"[{self.batch_size}, {plan.prefill_len + plan.verify_len}, ...]")
        if self.pool.spread and hidden.device != self.pool.device_of(layer):
            raise ValueError(f"RollbackPool.run: {type(layer).__name__} got hidden states on {hidden.device}; its "
                             f"states are on {self.pool.device_of(layer)} (the device its forward was expected to "
                             "run on when the pool was made)")
        if L == 0:
            raise ValueError(f"RollbackPool.run: hidden: got [{B}, 0, {D}]: a forward of no tokens (an empty "
                             "prompt?); expected at least one token per row")
        step = getattr(layer, "engine_forward", None) or layer  # adapters keep HF's forward
        outs = []
        if plan.prefill is not None:
            outs.append(step(hidden[:, :plan.prefill_len].reshape(-1, D), plan.prefill, self.pool).view(B, -1, D))
        if plan.verify is not None:
            outs.append(step(hidden[:, plan.prefill_len:].reshape(-1, D), plan.verify, self.pool).view(B, -1, D))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    # ------------------------------------------------------------------ crop
    def crop(self, num_tokens: int) -> None:
        """Remove the last ``num_tokens`` tokens of every row; commit the other pending ones.

        Raises:
            ValueError: ``num_tokens`` negative or more than the pending tokens (nothing changes).
        """
        m = int(num_tokens)
        pending = self.pending
        if m < 0 or m > pending:
            raise ValueError(f"crop: cannot remove {m} tokens: only the last {pending} are held "
                             f"(max_pending={self.max_pending}); raise max_pending for deeper rollbacks")
        self._absorb()
        keep = self._pending_len - m
        if keep:
            self._commit_pending(keep, into_checkpoint=True)
        self._pending.clear()
        self._pending_len = 0
        self._scratch_len = 0
        self.seen -= m

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder the rows (beam search): row ``b`` becomes old row ``index[b]``."""
        self._absorb()
        idx = index.to(device=self.device, dtype=torch.long)
        on = self.pool.per_device(idx, torch.cat([idx, idx + self.batch_size]))
        for key, _, state, _ in self._groups():
            state[:, : 2 * self.batch_size] = state[:, on[key[0]][1]]
        for key, recs in self._pending.items():
            self._pending[key] = tuple(r[:, on[key[0]][0]] for r in recs)

    # ------------------------------------------------------------------ internals
    def _groups(self):
        """``((device, spec), commit op, state, records)`` per state group of the pool."""
        for key, (state, records) in self.pool.gdn_groups.items():
            yield key, "gdn_commit", state, tuple(records)
        for key, (state, records) in self.pool.conv_groups.items():
            yield key, "short_conv_commit", state, (records,)

    def _absorb(self) -> None:
        """Move the last forward's records from the pool's buffers to the pending store."""
        t = self._unabsorbed
        if not t:
            return
        B = self.batch_size
        for key, _, _, records in self._groups():
            new = tuple(r[:, : B * t].unflatten(1, (B, t)).clone() for r in records)
            old = self._pending.get(key)
            if old is not None and old[0].shape[2]:
                new = tuple(torch.cat([o, n], 2) for o, n in zip(old, new))
            self._pending[key] = new
        self._pending_len += t
        self._unabsorbed = 0

    def _commit_pending(self, n: int, *, into_checkpoint: bool) -> None:
        """Replay pending tokens: the first ``n`` into the checkpoints (then drop them), or,
        for the scratch slots, tokens ``[scratch_len, n)`` on top of what they hold."""
        lo = 0 if into_checkpoint else self._scratch_len
        count = n - lo
        if count <= 0:
            return
        for key, op, state, _ in self._groups():
            device = key[0]
            ckpt, scratch, none = self._slots[device]
            src = ckpt if into_checkpoint or lo == 0 else scratch
            dst = ckpt if into_checkpoint else scratch
            qsl, counts = self._count_tensors(count, device)
            recs = tuple(r[:, :, lo:n].flatten(1, 2) for r in self._pending[key])
            self.pool.launch(device, op, state, *recs, qsl, src, counts, dst, none, none)
        if into_checkpoint:
            for key, recs in self._pending.items():
                self._pending[key] = tuple(r[:, :, n:] for r in recs)
            self._pending_len -= n
            self._scratch_len = max(0, self._scratch_len - n)
        else:
            self._scratch_len = n

    def _count_tensors(self, count: int, device):
        """``(query_start_loc [B+1], num_accepted_tokens [B])`` int32 for ``count`` tokens per row
        on ``device``, made once per count and device (no allocation or fill launch per commit)."""
        cached = self._counts.get((count, device))
        if cached is None:
            B = self.batch_size
            cached = self._counts[count, device] = (
                torch.arange(0, B * count + 1, count, dtype=torch.int32, device=device),
                torch.full((B,), count, dtype=torch.int32, device=device))
        return cached

    def _bring_scratch_up_to_date(self) -> str:
        """Make the scratch slots hold checkpoint + every pending token; say where to read."""
        if not self._pending_len:
            self._scratch_len = 0
            return "checkpoint"
        self._commit_pending(self._pending_len, into_checkpoint=False)
        return "scratch"

    def _ensure_record_capacity(self, tokens: int) -> None:
        if tokens <= self.pool.max_tokens:
            return
        bigger = StatePool(self.layers, num_slots=self.pool.num_slots, max_tokens=max(tokens, 2 * self.pool.max_tokens),
                           **self._pool_kwargs)
        for (new, _), (old, _) in zip((*bigger.gdn_groups.values(), *bigger.conv_groups.values()),
                                      (*self.pool.gdn_groups.values(), *self.pool.conv_groups.values())):
            new.copy_(old)
        self.pool = bigger
