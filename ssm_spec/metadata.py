"""``RecoverSSMMetadata``: the per-step metadata every layer and the commit share.

Built once per step from host-side scheduling data, validated once, then moved to the device;
nothing in the step reads it back on the host (docs/design.md section 5.4). Prefill rows keep a small
host-side plan (token range, initial and final slots, boundary slots) because the chunked
prefill runs eagerly per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .ops import NULL_SLOT

__all__ = ["RecoverSSMMetadata", "PrefillRow"]


@dataclass(frozen=True)
class PrefillRow:
    """Host plan of one prefill row.

    Attributes:
        row: the row index; bos, eos: its tokens ``[bos, eos)``.
        src: the slot holding the state before the chunk, or ``NULL_SLOT`` for a fresh request
            (zero state).
        dst: the slot receiving the final state.
        boundaries: ``((offset, slot), ...)``: align mode's states after ``offset`` tokens.
    """

    row: int
    bos: int
    eos: int
    src: int
    dst: int
    boundaries: tuple[tuple[int, int], ...] = ()


def group_prefill_rows(rows) -> tuple[dict[int, list[PrefillRow]], list[PrefillRow]]:
    """``(groups, rest)``: the prefill ``rows`` without align-mode boundaries in groups of one
    length (``{length: rows}``, two rows or more each), the others (single-length rows and rows
    with boundaries) in ``rest``, for the per-row path. A group runs as one batched prefill."""
    groups: dict[int, list] = {}
    rest = []
    for row in rows:
        (rest if row.boundaries else groups.setdefault(row.eos - row.bos, [])).append(row)
    for length in [n for n, group in groups.items() if len(group) == 1]:
        rest.extend(groups.pop(length))
    return groups, rest


def _fail(arg, got, expected):
    raise ValueError(f"RecoverSSMMetadata: {arg}: got {got}; expected {expected}")


@dataclass(frozen=True)
class RecoverSSMMetadata:
    """Per-step metadata (build it with :meth:`build`).

    Device tensors (int32 unless noted):
        query_start_loc ``[B + 1]``; is_prefill ``[B]`` bool; num_computed_tokens ``[B]``;
        verify_indices ``[B]``: the checkpoint slot each verify row reads (``NULL_SLOT`` for
        prefill, padding and empty fresh rows: the commit skips them); fresh_slots ``[F]``:
        checkpoints of verify rows admitted this step (zeroed by the layers before they
        verify);
        block_table ``[B, ncols]`` (align mode only).

        verify_query_start_loc ``[B + 1]``: the windows relative to :attr:`verify_span`.
        state_indices ``[B]``: the slot of each row as the caller gave it (``NULL_SLOT`` for
        padding); ``None`` in align mode (the block table holds the slots).

    Host values:
        num_tokens ``T``; verify_start / verify_stop (the verify span); num_rows ``B``; block_size (align mode) or None; max_window (the
        longest verify window, which sizes the boundary plan); prefill_rows (a
        :class:`PrefillRow` per prefill row).
    """

    query_start_loc: torch.Tensor
    is_prefill: torch.Tensor
    num_computed_tokens: torch.Tensor
    verify_indices: torch.Tensor
    fresh_slots: torch.Tensor
    block_table: torch.Tensor | None
    num_tokens: int
    num_rows: int
    block_size: int | None
    max_window: int
    prefill_rows: tuple[PrefillRow, ...]
    max_slot: int = NULL_SLOT
    verify_start: int = 0
    verify_stop: int = 0
    verify_query_start_loc: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None

    @property
    def verify_span(self) -> slice:
        """The tokens ``[verify_start, verify_stop)`` that hold every verify window: the ops
        run on this span (``verify_query_start_loc`` is relative to it), so the replay records
        need only ``verify_stop - verify_start`` rows, not one per prefill token."""
        return slice(self.verify_start, self.verify_stop)

    def check_pool(self, num_slots: int) -> None:
        """Raise ``ValueError`` (before anything is written) if the step references a slot the
        pool does not have; the layers call it with their pool's slot count."""
        if self.max_slot >= num_slots:
            _fail("slots", f"slot {self.max_slot}", f"slots < the pool's {num_slots}")

    @property
    def align(self) -> bool:
        return self.block_size is not None

    @property
    def device(self) -> torch.device:
        """Where the device tensors live."""
        return self.query_start_loc.device

    def to(self, device) -> RecoverSSMMetadata:
        """This metadata with its device tensors on ``device``: itself when they are there
        already (no copy, no launch), else a copy made at the first call for that device and
        kept with this metadata, so every later call (every layer on that device, every step
        that reuses the metadata) gets the same tensors. Layers on another device than the
        metadata's (a :class:`~ssm_spec.StatePool` spread over devices) call it; the host plan
        is shared.

        The copy is taken once: metadata whose tensors are refilled in place between steps
        (:meth:`uniform_verify` over static buffers) is for a pool on one device.
        """
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if self.query_start_loc.device == device:
            return self
        copies = self.__dict__.get("_copies")
        if copies is None:
            copies = {}
            object.__setattr__(self, "_copies", copies)  # a cache beside the (frozen) fields
        got = copies.get(device)
        if got is None:
            moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                     if isinstance(getattr(self, f.name), torch.Tensor)}
            got = copies[device] = dataclasses.replace(self, **moved)
        return got

    @property
    def has_verify(self) -> bool:
        return self.max_window > 0

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        is_prefill: Sequence[bool],
        num_computed_tokens: Sequence[int],
        state_indices: Sequence[int] | torch.Tensor | None = None,
        *,
        block_size: int | None = None,
        block_table: Sequence[Sequence[int]] | torch.Tensor | None = None,
        num_slots: int | None = None,
        device=None,
    ) -> RecoverSSMMetadata:
        """Validate the step's scheduling data on the host and build the device metadata.

        Args:
            query_lens: tokens of each row this step (a verify row: its window, 1 for plain
                decode; a prefill row: its prompt chunk). Rows are laid out in this order.
            is_prefill: per row, prefill (chunked GDN prefill, final state written, no commit)
                or verify (read-only checkpoint, record, commit later). Any mix and order.
            num_computed_tokens: tokens already committed for the row's request (0: a fresh
                request, which starts from the zero state).
            state_indices: one slot per row (``NULL_SLOT``: a padding row, which must have no
                tokens); not used in align mode.
            block_size: align mode (prefix caching): block column ``p`` of a row holds the
                state after ``(p + 1) * block_size`` tokens.
            block_table: align mode: ``[B, ncols]`` slots per row (``NULL_SLOT``: none); a row
                whose whole table is null is padding.
            num_slots: the pool's slot count, to range-check slots (recommended).
            device: where the metadata lives (the pool's device).

        Raises:
            ValueError: naming the argument: inconsistent lengths, a padding row with tokens,
                a slot that two rows write or that one row writes and another reads (rows may
                share a read-only checkpoint block), a slot out of range, or (align mode) a
                column the step may read or write that lies past the row's table, is null, or
                repeats a slot of the same step.
        """
        B = len(query_lens)
        lens = [int(n) for n in query_lens]
        pre = [bool(p) for p in is_prefill]
        nct = [int(n) for n in num_computed_tokens]
        if len(pre) != B or len(nct) != B:
            _fail("is_prefill / num_computed_tokens", f"lengths {len(pre)} / {len(nct)}", f"{B} (one per row)")
        for b in range(B):
            if lens[b] < 0:
                _fail(f"query_lens[{b}]", lens[b], ">= 0")
            if nct[b] < 0:
                _fail(f"num_computed_tokens[{b}]", nct[b], ">= 0")
        align = block_size is not None
        if align:
            if block_table is None or state_indices is not None:
                _fail("block_table / state_indices", "state_indices or no block_table",
                      "block_table (and no state_indices) in align mode")
            if int(block_size) < 1:
                _fail("block_size", block_size, ">= 1")
            bs = int(block_size)
            table = block_table.tolist() if isinstance(block_table, torch.Tensor) else [list(r) for r in block_table]
            if len(table) != B or len({len(r) for r in table}) > 1:
                _fail("block_table", f"{len(table)} rows of lengths {sorted({len(r) for r in table})}",
                      f"{B} rows of one length")
            ncols = len(table[0]) if table else 0
        else:
            if state_indices is None or block_table is not None:
                _fail("state_indices / block_table", "no state_indices or a block_table",
                      "state_indices (and no block_table) outside align mode")
            slots = state_indices.tolist() if isinstance(state_indices, torch.Tensor) else [int(s) for s in state_indices]
            if len(slots) != B:
                _fail("state_indices", f"{len(slots)} entries", f"{B} (one per row)")

        def check_slot(arg, slot):
            if num_slots is not None and slot >= num_slots:
                _fail(arg, slot, f"a slot < num_slots = {num_slots}")

        writers: dict[int, int] = {}
        readers: dict[int, set] = {}

        def claim_write(arg, slot, row):
            """A slot the row may write: no other row may write or read it."""
            check_slot(arg, slot)
            if writers.setdefault(slot, row) != row:
                _fail(arg, f"slot {slot}", f"a slot no other row writes (row {writers[slot]} does)")
            others = readers.get(slot, set()) - {row}
            if others:
                _fail(arg, f"slot {slot}", f"not another row's checkpoint (row {min(others)} reads it)")

        def claim_read(arg, slot, row):
            """A checkpoint the row only reads: rows may share it (a cached prefix block)."""
            check_slot(arg, slot)
            if writers.get(slot, row) != row:
                _fail(arg, f"slot {slot}", f"a checkpoint no other row writes (row {writers[slot]} does)")
            readers.setdefault(slot, set()).add(row)

        def column(b, col, why):
            if col >= ncols:
                _fail(f"block_table[{b}]", f"{ncols} columns", f"a column {col} ({why}; block_size {bs})")
            if table[b][col] < 0:
                _fail(f"block_table[{b}, {col}]", "the null slot", f"a slot ({why})")
            return table[b][col]

        verify_idx, fresh, prefill_rows = [], [], []
        bos = 0
        for b in range(B):
            L, nc = lens[b], nct[b]
            eos = bos + L
            if align:
                row = table[b]
                if all(s < 0 for s in row):  # padding row
                    if L:
                        _fail(f"block_table[{b}]", "only null slots for a row with tokens", "a real slot")
                    verify_idx.append(NULL_SLOT)
                    bos = eos
                    continue
                checkpoint = NULL_SLOT
                if nc > 0:
                    checkpoint = column(b, (nc - 1) // bs, f"the checkpoint, block of token {nc}")
                    claim_read(f"block_table[{b}, {(nc - 1) // bs}]", checkpoint, b)
                if L:
                    cols = range(nc // bs, (nc + L - 1) // bs + 1)  # every block the step may write
                    slots_w = [column(b, c, f"the block of token {(c + 1) * bs} the step may write") for c in cols]
                    if len(set(slots_w)) != len(slots_w):
                        _fail(f"block_table[{b}]", f"slots {slots_w} for columns {list(cols)}",
                              "distinct slots for the blocks one step may write")
                    for c, slot in zip(cols, slots_w):
                        claim_write(f"block_table[{b}, {c}]", slot, b)
                if pre[b] and L:
                    bounds = tuple(((p + 1) * bs - nc, row[p]) for p in range(nc // bs, (nc + L) // bs))
                    prefill_rows.append(PrefillRow(b, bos, eos, checkpoint, row[(nc + L - 1) // bs], bounds))
                    verify_idx.append(NULL_SLOT)
                elif pre[b] or (nc == 0 and not L):  # an empty window reads and writes nothing
                    verify_idx.append(NULL_SLOT)
                elif nc == 0:  # a fresh request verifying: its first block starts from zeros
                    verify_idx.append(row[0])
                    fresh.append(row[0])
                else:
                    verify_idx.append(checkpoint)
            else:
                slot = slots[b]
                if slot < 0:
                    if L:
                        _fail(f"state_indices[{b}]", f"{slot} (padding) for a row with {L} tokens",
                              "a slot >= 0, or no tokens")
                    verify_idx.append(NULL_SLOT)
                    bos = eos
                    continue
                claim_write(f"state_indices[{b}]", slot, b)
                if pre[b] and L:
                    prefill_rows.append(PrefillRow(b, bos, eos, slot if nc > 0 else NULL_SLOT, slot))
                    verify_idx.append(NULL_SLOT)
                elif pre[b] or (nc == 0 and not L):  # an empty window reads and writes nothing
                    verify_idx.append(NULL_SLOT)
                else:
                    verify_idx.append(slot)
                    if nc == 0:
                        fresh.append(slot)
            bos = eos

        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        windows = [lens[b] for b in range(B) if not pre[b] and verify_idx[b] >= 0]
        spans = [(qsl[b], qsl[b + 1]) for b in range(B) if verify_idx[b] >= 0 and lens[b]]
        lo, hi = (min(a for a, _ in spans), max(z for _, z in spans)) if spans else (0, 0)
        return cls(
            query_start_loc=i32(qsl),
            is_prefill=torch.tensor(pre, dtype=torch.bool, device=device),
            num_computed_tokens=i32(nct),
            verify_indices=i32(verify_idx),
            fresh_slots=i32(fresh),
            block_table=i32(table).reshape(B, ncols) if align else None,
            num_tokens=qsl[-1],
            num_rows=B,
            block_size=int(block_size) if align else None,
            max_window=max(windows, default=0),
            prefill_rows=tuple(prefill_rows),
            max_slot=max([*writers, *readers], default=NULL_SLOT),
            verify_start=lo,
            verify_stop=hi,
            verify_query_start_loc=i32([min(max(q - lo, 0), hi - lo) for q in qsl]),
            state_indices=None if align else i32(slots),
        )

    @classmethod
    def uniform_verify(cls, state_indices: torch.Tensor, num_computed_tokens: torch.Tensor,
                       query_start_loc: torch.Tensor, window: int) -> RecoverSSMMetadata:
        """The metadata of a uniform verify step, built on the device with no host read.

        Every row owns ``window`` consecutive token positions (``query_start_loc[b] = b *
        window``), verifies them against its checkpoint ``state_indices[b]`` and commits
        later; a row whose slot is ``NULL_SLOT`` is padding (reads and writes nothing). Rows
        may carry fewer real tokens than ``window``: the positions after them are verified
        like any others (causal, so the real ones are unaffected) and the commit, whose counts
        never exceed the real length, never replays them. This is the step :mod:`ssm_spec.graphs`
        captures: its shapes depend only on ``B`` and ``window``.

        Nothing is validated here (it would read the values back); the caller checks slots
        and counts before it fills the buffers these tensors view. Every real row must hold a
        committed state (``num_computed_tokens > 0``: prefill runs outside the uniform step),
        and there is no align mode.

        Args:
            state_indices: ``[B]`` int32 slots (``NULL_SLOT``: padding).
            num_computed_tokens: ``[B]`` int32 committed tokens per row.
            query_start_loc: ``[B + 1]`` int32, ``arange(B + 1) * window``.
            window: ``W``, tokens per row.

        Raises:
            ValueError: on shapes that do not fit ``B`` rows, a ``window`` that is not an int
                ``>= 1``, or tensors that are not int32.
        """
        if not isinstance(window, int) or any(t.dtype != torch.int32 for t in (state_indices, num_computed_tokens,
                                                                              query_start_loc)):
            _fail("uniform_verify", f"window {window!r}, dtypes {state_indices.dtype}, {num_computed_tokens.dtype}, "
                  f"{query_start_loc.dtype}", "an int window and int32 tensors")
        B = state_indices.shape[0]
        if window < 1 or state_indices.dim() != 1 or num_computed_tokens.shape != (B,) \
                or query_start_loc.shape != (B + 1,):
            _fail("uniform_verify", f"state_indices {list(state_indices.shape)}, num_computed_tokens "
                  f"{list(num_computed_tokens.shape)}, query_start_loc {list(query_start_loc.shape)}, "
                  f"window {window}", "[B], [B], [B + 1] and window >= 1")
        T = B * window
        return cls(
            query_start_loc=query_start_loc,
            is_prefill=torch.zeros(B, dtype=torch.bool, device=state_indices.device),
            num_computed_tokens=num_computed_tokens,
            verify_indices=state_indices,
            fresh_slots=state_indices[:0],
            block_table=None,
            num_tokens=T,
            num_rows=B,
            block_size=None,
            max_window=window,
            prefill_rows=(),
            verify_start=0,
            verify_stop=T,
            verify_query_start_loc=query_start_loc,
            state_indices=state_indices,
        )
