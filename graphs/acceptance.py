"""On-device acceptance of a uniform spec-decode step: greedy matching and speculative
rejection sampling, with no host sync and no data-dependent shapes (capture-safe).

A row's window is ``W`` tokens: the last accepted token ``x_0``, then drafts ``x_1..x_k``
(``k = W - 1``); only the first ``window_lens[b]`` are real (0: a padding row). The target's
logits at window position ``i`` predict the token after ``x_i``. A row accepts the longest
prefix of drafts that passes, then adds one token of its own (the bonus): the target's choice
after the last accepted token. Outputs (docs/design.md section 6):

* ``accepted_tokens [B, W]`` int64: the ``a`` accepted drafts, then the bonus token, then
  ``pad_token``;
* ``num_accepted_tokens [B]`` int32: ``a + 1`` window tokens whose state the commit keeps
  (``x_0..x_a``); 0 for padding rows.

Speculative sampling follows Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding" (Algorithm 1) and Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling": draft ``x`` drawn from ``q`` is kept with probability
``min(1, p(x) / q(x))``; at the first rejection the bonus is drawn from
``norm(max(0, p - q))``, and after ``k`` acceptances from ``p`` at position ``k``. The output
tokens are then distributed exactly as sampling from the target. Categorical draws use the
exponential-race form (``argmax(probs / E)``, ``E ~ Exp(1)``), which needs only ``rand`` from a
device generator.
"""

from __future__ import annotations

import torch

__all__ = ["greedy_accept", "rejection_sample_accept"]


def _check(window_tokens, window_lens, logits):
    if window_tokens.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != window_tokens.shape:
        raise ValueError(f"acceptance: window_tokens [B, W] and logits [B, W, vocab] expected; got "
                         f"{list(window_tokens.shape)} and {list(logits.shape)}")
    if window_lens.shape != window_tokens.shape[:1]:
        raise ValueError(f"acceptance: window_lens: got shape {list(window_lens.shape)}; "
                         f"expected [{window_tokens.shape[0]}]")


def _finish(window_tokens, window_lens, passed, bonus, pad_token):
    """``passed [B, k]`` bool per draft -> accepted tokens and counts (prefix rule, real drafts)."""
    B, W = window_tokens.shape
    lens = window_lens.to(torch.int64).clamp(0, W)
    k_real = (lens - 1).clamp_min(0)
    pos = torch.arange(W - 1, device=window_tokens.device)
    ok = passed & (pos[None, :] < k_real[:, None])
    a = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading accepted drafts
    cols = torch.arange(W, device=window_tokens.device)[None, :]
    drafts = torch.cat([window_tokens[:, 1:], window_tokens[:, :1]], dim=1)  # x_1..x_k, then filler
    out = torch.where(cols < a[:, None], drafts, torch.full_like(drafts, pad_token))
    out = torch.where(cols == a[:, None], bonus.gather(1, a[:, None]).expand(-1, W), out)
    real = lens > 0
    out = torch.where(real[:, None], out, torch.full_like(out, pad_token))
    n = torch.where(real, a + 1, torch.zeros_like(a)).to(torch.int32)
    return out, n


def greedy_accept(window_tokens: torch.Tensor, window_lens: torch.Tensor, logits: torch.Tensor,
                  pad_token: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while each equals the target's argmax.

    Args:
        window_tokens: ``[B, W]`` int64, ``x_0`` then the drafts.
        window_lens: ``[B]`` int, real tokens per row (``0..W``; 0 = padding row).
        logits: ``[B, W, vocab]`` target logits per window position, any float dtype.
        pad_token: filler for unused output positions.

    Returns:
        ``(accepted_tokens [B, W] int64, num_accepted_tokens [B] int32)`` (module docstring).

    Raises:
        ValueError: mismatched shapes.
    """
    _check(window_tokens, window_lens, logits)
    choice = logits.argmax(dim=-1)  # [B, W]: the target's token after each window position
    passed = window_tokens[:, 1:] == choice[:, :-1]
    return _finish(window_tokens, window_lens, passed, choice, pad_token)


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One categorical draw per row of ``probs [..., V]`` (unnormalised, non-negative)."""
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float32)
    e = -torch.log1p(-u)  # Exp(1); u in [0, 1) so e >= 0 and finite
    return (probs.float() / e).argmax(dim=-1)


def rejection_sample_accept(window_tokens: torch.Tensor, window_lens: torch.Tensor, logits: torch.Tensor,
                            draft_probs: torch.Tensor, temperature: float = 1.0,
                            generator: torch.Generator | None = None,
                            pad_token: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (module docstring), all on the device.

    Args:
        window_tokens, window_lens, logits: as :func:`greedy_accept`.
        draft_probs: ``[B, W - 1, vocab]`` the draft distribution ``q`` each draft was drawn
            from (rows sum to 1).
        temperature: the target's sampling temperature (``> 0``): ``p = softmax(logits / T)``.
        generator: a generator on the logits' device (capture: a graph-safe one).
        pad_token: filler for unused output positions.

    Returns:
        ``(accepted_tokens [B, W] int64, num_accepted_tokens [B] int32)``.

    Raises:
        ValueError: mismatched shapes or ``temperature <= 0``.
    """
    _check(window_tokens, window_lens, logits)
    B, W, V = logits.shape
    if draft_probs.shape != (B, W - 1, V):
        raise ValueError(f"rejection_sample_accept: draft_probs: got {list(draft_probs.shape)}; "
                         f"expected [{B}, {W - 1}, {V}]")
    if not temperature > 0:
        raise ValueError(f"rejection_sample_accept: temperature: got {temperature}; expected > 0")
    p = torch.softmax(logits.float() / temperature, dim=-1)  # [B, W, V]
    q = draft_probs.float()
    x = window_tokens[:, 1:, None]
    p_x = p[:, :-1].gather(2, x)[..., 0]
    q_x = q.gather(2, x)[..., 0]
    u = torch.rand((B, W - 1), generator=generator, device=logits.device, dtype=torch.float32)
    # probability min(1, p/q); a draft its own q gives probability 0 cannot have been drawn from
    # it: rejected rather than accepted on a malformed q (exactness then still holds)
    passed = (q_x > 0) & (u * q_x < p_x)
    residual = (p[:, :-1] - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual, p[:, :-1])  # p == q: a rejection never happens there
    # the bonus after a rejection at draft i comes from the residual at i; after all of a row's
    # real drafts (a = k_real, which may be < k in a ragged row) from p at that position
    k_real = (window_lens.to(torch.int64).clamp(0, W) - 1).clamp_min(0)
    after_all = torch.arange(W, device=logits.device)[None, :] >= k_real[:, None]
    residual = torch.cat([residual, p[:, -1:]], dim=1)
    bonus = _race(torch.where(after_all[..., None], p, residual), generator)
    return _finish(window_tokens, window_lens, passed, bonus, pad_token)
