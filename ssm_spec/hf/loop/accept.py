"""Scores and acceptance of one round of the decode loop, on the device with fixed shapes.

Window position ``j`` of row ``b`` predicts the row's new token number ``produced[b] + j``. The
scores there are the logits as transformers' ``generate`` would process them for that token: the
minimum-length processors mask the end-of-sequence tokens while the row is short, then the
sampling warpers (temperature, top-k, top-p, ...) run as transformers' own objects. Greedy
rounds keep drafts while they equal the argmax; sampling rounds follow transformers' assisted
decoding (prompt lookup: a draft is kept while it equals the token sampled at its position;
an assistant's drafts by speculative rejection sampling against its own distribution,
Leviathan et al. 2023, Algorithm 1). Draws use the exponential race (``argmax(p / E)``,
``E ~ Exp(1)``), which a CUDA graph replays with fresh numbers.
"""

from __future__ import annotations

import torch

__all__ = ["Scoring", "draw", "accept_greedy", "accept_matching", "accept_rejection", "unsupported_processor",
           "PROCESSORS", "WARPERS"]

#: Processors the loop applies itself (they depend on each position's length).
PROCESSORS = ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")
#: Warpers that only read the scores: the loop runs transformers' own objects on every position.
WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
           "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper")


class Scoring:
    """How a round turns logits into scores: transformers' prepared processors, split into the
    length-dependent masks the loop applies per position and the warpers it calls.

    Args:
        processors: the ``LogitsProcessorList`` transformers prepared for the call.
        eos: ``[E]`` int64 end-of-sequence ids on the device (may be empty).

    Raises:
        ValueError: a processor the loop does not implement (the caller falls back to
            transformers' loop first, see :func:`unsupported_processor`).
    """

    def __init__(self, processors, eos: torch.Tensor):
        self.eos = eos
        self.warpers = []
        self.masks_eos = False
        for p in processors:
            name = type(p).__name__
            if name in PROCESSORS:
                self.masks_eos = True
            elif name in WARPERS:
                self.warpers.append(p)
            else:
                raise ValueError(f"decode loop: logits processor {name} is not supported")

    def key(self) -> tuple:
        """What a captured round bakes in: the warpers' settings and whether EOS is masked."""
        return (self.masks_eos, tuple((type(w).__name__, tuple(sorted((k, v) for k, v in vars(w).items()
                                                                     if isinstance(v, (int, float, bool)))))
                                      for w in self.warpers))

    def __call__(self, logits: torch.Tensor, rows, offset: int = 0) -> torch.Tensor:
        """``logits [B, W, V]`` -> fp32 scores; position ``j`` is new token ``produced + offset + j``."""
        scores = logits.float()
        if self.masks_eos and self.eos.numel():
            B, W, _ = scores.shape
            new = rows.produced[:, None] + offset + torch.arange(W, device=scores.device)[None, :]
            short = (new < rows.min_new[:, None]) | (rows.start[:, None] + new < rows.min_length[:, None])
            # index_fill_ with a Python scalar: `mask[eos] = True` would copy a host tensor to the
            # device, a synchronising copy that a captured round cannot hold
            mask = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device).index_fill_(0, self.eos, True)
            scores = scores.masked_fill(short[..., None] & mask, -float("inf"))
        if self.warpers:
            B, W, V = scores.shape
            flat = scores.reshape(B * W, V)
            ids = torch.zeros((B * W, 1), dtype=torch.long, device=scores.device)  # warpers do not read them
            for w in self.warpers:
                flat = w(ids, flat)
            scores = flat.view(B, W, V)
        return scores


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row of ``probs [..., V]`` (non-negative, any scale)."""
    u = torch.rand(probs.shape, device=probs.device, dtype=torch.float32)
    return (probs.float() / -torch.log1p(-u)).argmax(dim=-1)


def _leading(passed: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """``[B]`` the count of leading ``True`` of ``passed [B, k]`` among each row's real drafts."""
    k = passed.shape[1]
    real = torch.arange(k, device=passed.device)[None, :] < num_drafts[:, None]
    return (passed & real).to(torch.int64).cumprod(dim=1).sum(dim=1)


def accept_greedy(drafts: torch.Tensor, num_drafts: torch.Tensor, scores: torch.Tensor):
    """Greedy: ``(emitted [B, W], accepted drafts [B])``; the emitted tokens are the argmax at
    every position (equal to the drafts before the first mismatch, then the target's own)."""
    choice = scores.argmax(dim=-1)
    return choice, _leading(drafts == choice[:, :-1], num_drafts)


def accept_matching(drafts: torch.Tensor, num_drafts: torch.Tensor, scores: torch.Tensor):
    """Sampling without draft probabilities (prompt lookup, as transformers' assisted decoding
    does it): a token sampled at every position, drafts kept while they equal it."""
    choice = draw(torch.softmax(scores, dim=-1))
    return choice, _leading(drafts == choice[:, :-1], num_drafts)


def accept_rejection(drafts: torch.Tensor, num_drafts: torch.Tensor, scores: torch.Tensor,
                     draft_probs: torch.Tensor):
    """Speculative rejection sampling against the drafts' own distributions ``draft_probs
    [B, k, V]``: draft ``x`` kept with probability ``min(1, p(x) / q(x))``; after the first
    rejection the next token is drawn from ``norm(max(0, p - q))``, after every real draft from
    ``p``. Returns ``(emitted [B, W], accepted drafts [B])``."""
    B, W, V = scores.shape
    k = W - 1
    p = torch.softmax(scores, dim=-1)
    q = draft_probs.float()
    x = drafts[..., None]
    p_x, q_x = p[:, :k].gather(2, x)[..., 0], q.gather(2, x)[..., 0]
    u = torch.rand((B, k), device=scores.device, dtype=torch.float32)
    a = _leading((q_x > 0) & (u * q_x < p_x), num_drafts)
    residual = (p[:, :k] - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, :k])
    after = torch.arange(W, device=scores.device)[None, :] >= num_drafts[:, None]
    bonus = draw(torch.where(after[..., None], p, torch.cat([residual, p[:, k:]], dim=1)))
    j = torch.arange(W, device=scores.device)[None, :]
    padded = torch.cat([drafts, drafts[:, :1]], dim=1)
    emitted = torch.where(j < a[:, None], padded, bonus.gather(1, a[:, None]).expand(B, W))
    return emitted, a


def unsupported_processor(processors) -> str | None:
    """The name of the first processor in ``processors`` the loop does not implement, or ``None``."""
    for p in processors:
        if type(p).__name__ not in (*PROCESSORS, *WARPERS):
            return type(p).__name__
    return None

