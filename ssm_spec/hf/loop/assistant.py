"""An assistant model as the decode loop's drafter, every step on the device.

The assistant keeps each row's state for the row's kept tokens except the last two (``p`` and
``x``: the last generated token is ``x``). Draft step ``j`` of a round verifies the window
``[p, x, d_0 .. d_{j-1}]`` (``j + 2`` tokens) from that state, read only, and takes draft
``d_j`` from its last position; the last step's window holds ``[p, x, d_0 .. d_{k-2}]``. Once
the target has kept ``a`` drafts, the assistant commits the first ``a + 1`` tokens of that
window, which leaves its state again two tokens behind the row. A GDN assistant (converted by
:func:`~ssm_spec.hf.apply_recoverssm`) rolls back with RecoverSSM's verify and commit; an
attention-only assistant's keys and values past a row's kept tokens are simply never attended
to. Step ``j`` costs a forward of ``j + 2`` tokens (``k (k + 3) / 2`` tokens a round): for a small
assistant the round's cost is its launches, not its tokens.
"""

from __future__ import annotations

import torch

from .accept import draw
from .forward import LoopModel

__all__ = ["AssistantDrafter"]


class AssistantDrafter:
    """Drafts ``k`` tokens per round with an assistant model.

    Args:
        model: the assistant (same vocabulary as the target): converted by
            ``apply_recoverssm`` when it has GatedDeltaNet layers, otherwise attention only.
        num_tokens: ``k`` (``num_assistant_tokens``).
        batch_size / capacity: the bucket's.
        scoring: the round's :class:`~ssm_spec.hf.loop.accept.Scoring` (the assistant's
            drafts are chosen from scores processed as the target's are).
        sampling: draw drafts from the assistant's distribution (kept for rejection sampling)
            instead of taking its argmax.
        state_dtype / mode / compile: the assistant's recurrent states and whether its verify
            forwards are compiled (its own :class:`~ssm_spec.hf.RecoverSSMConfig`; under
            ``compile="auto"`` the target loop's setting, whose captured round holds its steps).
    """

    def __init__(self, model, num_tokens: int, batch_size: int, capacity: int, scoring, sampling: bool, *,
                 state_dtype=torch.float32, mode: str = "exact", compile: bool = False):
        self.k = int(num_tokens)
        self.compiles = bool(compile)
        self.model = LoopModel(model, batch_size, capacity, self.k + 1, state_dtype=state_dtype, mode=mode,
                               compile=compile)
        self.scoring, self.sampling = scoring, sampling
        self.needs_probs = sampling
        self._last_md = None

    def key(self) -> tuple:
        return ("assistant", id(self.model.model), self.k, self.sampling)

    def start(self, rows, width: int) -> None:
        """After the prompt: feed each row's prompt but its last token (``width``: the prompt's
        columns minus one)."""
        self.model.prefill(rows, width)

    def propose(self, rows):
        """``(drafts [B, k], num_drafts [B], probs [B, k, V] or None)``."""
        active = ~rows.finished
        drafts = []
        probs = []
        B = rows.batch_size
        base = rows.window_tokens(rows.window_columns(2, back=2))  # [p, x]
        for j in range(self.k):
            columns = rows.window_columns(j + 2, back=2)
            tokens = torch.cat([base, *[d[:, None] for d in drafts]], dim=1) if drafts else base
            logits, self._last_md = self.model.verify(tokens, columns, rows, active)
            scores = self.scoring(logits[:, -1:], rows, offset=j)[:, 0]
            if self.sampling:
                p = torch.softmax(scores, dim=-1)
                drafts.append(draw(p))
                probs.append(p)
            else:
                drafts.append(scores.argmax(dim=-1))
        count = torch.full((B,), self.k, dtype=torch.int64, device=rows.device)
        return torch.stack(drafts, dim=1), count, torch.stack(probs, dim=1) if self.sampling else None

    def accept(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        """The target kept ``accepted [B]`` drafts of each ``active`` row: commit ``a + 1`` tokens
        of the last step's window."""
        n = torch.where(active, accepted + 1, torch.zeros_like(accepted))
        self.model.commit(self._last_md, n)
