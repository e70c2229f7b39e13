"""The decode loop's per-row bookkeeping, all on the device (docs/design.md section 7.7).

Row ``b`` of a batch bucket holds its prompt in columns ``0 .. P - 1`` of the token buffer, left
padded (``pad[b]`` padding columns first), and its ``produced[b]`` generated tokens from column
``P`` on. ``P`` is the loop's prompt width: the call's prompt columns, or more when the loop
rounds widths up so that captured prefills are shared (the extra columns are more left padding). Its last generated token, not yet fed to the target, is at column
``P + produced[b] - 1``. Rows past the real ones, and rows that have finished, are padding rows:
nothing they compute is kept.
"""

from __future__ import annotations

import torch

from .forward import compiled

__all__ = ["Rows"]


class Rows:
    """Token buffer and per-row counters of one batch bucket.

    Args:
        batch_size: rows of the bucket.
        capacity: token columns (prompt, new tokens and one window).
        device: where everything lives.
        pad_token_id: filler of unused columns (and of each row after it ends, as
            ``generate`` pads).
        compile: :meth:`append` through ``torch.compile(fullgraph=True, dynamic=False)``
            (integer operations only: the same tokens, its small kernels fused).

    Attributes (device tensors, updated in place so captured graphs see the current values):
        tokens: ``[B, capacity]`` int64.
        pad: ``[B]`` int64 left-padding columns of each row.
        start: ``[B]`` int64, ``P`` (the prompt width) in every row.
        produced: ``[B]`` int64 tokens generated.
        finished: ``[B]`` bool (padding rows are finished from the start).
        max_new / min_new / min_length: ``[B]`` int64 budgets (``min_length`` counts the prompt's
            columns too, as transformers' ``min_length`` does).
    """

    def __init__(self, batch_size: int, capacity: int, device, pad_token_id: int, compile: bool = False):
        self.batch_size, self.capacity, self.device = int(batch_size), int(capacity), torch.device(device)
        self.pad_token_id = int(pad_token_id)
        i64 = dict(dtype=torch.int64, device=self.device)
        B = self.batch_size
        self.tokens = torch.full((B, self.capacity), self.pad_token_id, **i64)
        self.pad = torch.zeros(B, **i64)
        self.start = torch.zeros(B, **i64)
        self.produced = torch.zeros(B, **i64)
        self.finished = torch.ones(B, dtype=torch.bool, device=self.device)
        self.max_new = torch.zeros(B, **i64)
        self.min_new = torch.zeros(B, **i64)
        self.min_length = torch.zeros(B, **i64)
        self.columns = torch.arange(self.capacity, **i64)
        self._append = compiled(Rows._write) if compile else Rows._write  # a function of (self, ...): no cycle

    def load(self, prompt: torch.Tensor, pad: torch.Tensor, max_new: int, min_new: int, min_length: int,
             width: int | None = None) -> None:
        """Start the rows of ``prompt [b, P]`` (left padded by ``pad [b]``) in the first ``b`` rows,
        right-aligned in ``width`` columns (default ``P``; more columns are more left padding);
        the rest become padding rows. ``min_length`` counts ``P`` prompt columns, as
        transformers' ``min_length`` does.

        Raises:
            ValueError: ``width`` below ``P``.
        """
        b, P = prompt.shape
        width = P if width is None else int(width)
        if width < P:
            raise ValueError(f"Rows.load: width={width} is below the prompt's {P} columns")
        shift = width - P
        self.tokens.fill_(self.pad_token_id)
        self.tokens[:b, shift:width] = prompt
        self.pad.zero_()
        self.pad[:b] = pad + shift
        self.start.fill_(width)
        self.produced.zero_()
        self.finished.fill_(True)
        self.finished[:b] = False
        self.max_new.fill_(max_new)
        self.min_new.fill_(min_new)
        self.min_length.fill_(min_length + shift)

    def window_columns(self, width: int, back: int = 1) -> torch.Tensor:
        """``[B, width]`` columns of a window that starts ``back`` columns before the next new
        token's (``back=1``: the last generated token, then the drafts), clamped to the buffer
        (a finished row's window may run past it: nothing it computes is kept)."""
        first = self.start + self.produced - back
        cols = first[:, None] + torch.arange(width, device=self.device)[None, :]
        return cols.clamp(0, self.capacity - 1)

    def window_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        return self.tokens.gather(1, columns)

    def last_token(self) -> torch.Tensor:
        """``[B]`` each row's last generated token."""
        col = (self.start + self.produced - 1).clamp(0, self.capacity - 1)
        return self.tokens.gather(1, col[:, None])[:, 0]

    def append(self, emitted: torch.Tensor, count: torch.Tensor, eos: torch.Tensor | None) -> torch.Tensor:
        """Write each active row's first ``count[b]`` tokens of ``emitted [B, W]`` after its
        generated ones, stopping after an end-of-sequence token or at the row's budget; rows
        that reach either finish. Returns ``[B]`` int64, the tokens each row kept (0 for rows
        that were finished)."""
        return self._append(self, emitted, count, eos)

    def _write(self, emitted: torch.Tensor, count: torch.Tensor, eos: torch.Tensor | None) -> torch.Tensor:
        B, W = emitted.shape
        active = ~self.finished
        j = torch.arange(W, device=self.device)[None, :]
        n = torch.minimum(count, self.max_new - self.produced).clamp_min(0)
        if eos is not None and eos.numel():
            is_eos = (emitted[..., None] == eos).any(-1) & (j < n[:, None])
            first = torch.where(is_eos, j, torch.full_like(j, W)).amin(1)
            n = torch.minimum(n, first + 1)
            hit = first < n
        else:
            hit = torch.zeros_like(active)
        n = torch.where(active, n, torch.zeros_like(n))
        cols = (self.start + self.produced)[:, None] + j
        keep = j < n[:, None]
        safe = cols.clamp_max(self.capacity - 1)
        self.tokens.scatter_(1, safe, torch.where(keep, emitted, self.tokens.gather(1, safe)))
        self.produced += n
        self.finished |= active & (hit | (self.produced >= self.max_new))
        return n
