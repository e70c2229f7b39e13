"""Prompt lookup on the device: the drafts transformers' prompt lookup proposes, for every row at
once, with fixed shapes (no host read, so a CUDA graph holds it).

For each row, as transformers' ``PromptLookupCandidateGenerator`` does for its one sequence: for
n-gram sizes from ``max_matching_ngram_size`` (capped at the sequence length minus one) down
to 1, find the first (leftmost) earlier occurrence of the sequence's last ``n`` tokens that has
at least one token after it; the drafts are the up to ``k`` tokens that follow it within the
sequence, cut before the first end-of-sequence token. The largest ``n`` with such an occurrence
wins. No drafts when the row has one new token of budget left, or nothing matches.
"""

from __future__ import annotations

import torch

from .forward import compiled

__all__ = ["PromptLookup", "DEFAULT_MAX_NGRAM"]

#: transformers' default ``max_matching_ngram_size``.
DEFAULT_MAX_NGRAM = 2


class PromptLookup:
    """Drafts by n-gram lookup over each row's own tokens.

    Args:
        num_tokens: ``k``, the most drafts per round (``prompt_lookup_num_tokens``).
        max_ngram: the largest n-gram matched (``max_matching_ngram_size``; default 2).
        eos: ``[E]`` int64 end-of-sequence ids (drafts stop before one).
        compile: the search through ``torch.compile(fullgraph=True, dynamic=False)``
            (:func:`~ssm_spec.hf.loop.forward.compiled`): integer operations only, so the drafts
            are the same; inductor fuses its few dozen small kernels (what a captured round of a
            small model spends its time on) into a handful.

    Raises:
        ValueError: ``num_tokens`` or ``max_ngram`` below 1.
    """

    needs_probs = False

    def __init__(self, num_tokens: int, max_ngram: int | None, eos: torch.Tensor, compile: bool = False):
        self.k = int(num_tokens)
        self.max_ngram = DEFAULT_MAX_NGRAM if max_ngram is None else int(max_ngram)
        if self.k < 1 or self.max_ngram < 1:
            raise ValueError(f"prompt lookup: prompt_lookup_num_tokens={num_tokens}, max_matching_ngram_size="
                             f"{max_ngram}; expected >= 1")
        self.eos = eos
        self.compiles = bool(compile)
        self._search = compiled(PromptLookup._propose) if compile else PromptLookup._propose  # no cycle

    def key(self) -> tuple:
        return ("lookup", self.k, self.max_ngram, int(self.eos.numel()))

    def propose(self, rows):
        """``(drafts [B, k] int64, num_drafts [B] int64, None)`` for every row of ``rows``."""
        drafts, count = self._search(self, rows)
        return drafts, count, None

    def _propose(self, rows):
        tokens, N = rows.tokens, rows.capacity
        end = rows.start + rows.produced  # each row's sequence is columns pad .. end - 1
        length = end - rows.pad
        cols = rows.columns
        best = torch.full_like(end, -1)  # first column of the chosen continuation
        for n in range(self.max_ngram, 0, -1):
            last = tokens.gather(1, (end[:, None] - n + torch.arange(n, device=tokens.device)[None, :]).clamp(0, N - 1))
            win = tokens.unfold(1, n, 1)  # [B, N - n + 1, n]: window s holds columns s .. s + n - 1
            s = cols[: N - n + 1]
            valid = (win == last[:, None, :]).all(-1) & (s[None, :] >= rows.pad[:, None]) & (
                s[None, :] + n < end[:, None]) & (length[:, None] - 1 >= n)
            first = torch.where(valid, s[None, :], torch.full_like(s[None, :], N)).amin(1)
            best = torch.where((best < 0) & (first < N), first + n, best)
        found = (best >= 0) & (rows.max_new - rows.produced > 1)
        j = torch.arange(self.k, device=tokens.device)[None, :]
        take = (best.clamp_min(0)[:, None] + j).clamp_max(N - 1)
        drafts = tokens.gather(1, take)
        count = torch.where(found, torch.minimum(end - best, torch.full_like(end, self.k)), torch.zeros_like(end))
        if self.eos.numel():
            is_eos = (drafts[..., None] == self.eos).any(-1)
            first_eos = torch.where(is_eos, j, torch.full_like(j, self.k)).amin(1)
            count = torch.minimum(count, first_eos)
        filler = rows.last_token()[:, None].expand_as(drafts)
        drafts = torch.where(j < count[:, None], drafts, filler)
        return drafts, count
