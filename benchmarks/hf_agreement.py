"""Whether two runs' greedy tokens agree, and where they part the logit gaps there (top-1 minus
top-2, and one run's token minus the other's): shared by the random-weight runs and the demo pair."""

from __future__ import annotations

import torch


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (``None`` when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``[L, V]`` fp32 logits of one forward over ``ids [1, L]`` from an empty cache (with a
    cache, so transformers runs the same kernel variants as in a prompt prefill: fla's
    chunked kernels specialise on storing the final state)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return out.logits[0].float()


def gap_at(logits: torch.Tensor, pos: int, tok_a: int, tok_b: int) -> dict:
    row = logits[pos]
    top = torch.topk(row, 2)
    return {"top1_minus_top2": float(top.values[0] - top.values[1]),
            "top1_token": int(top.indices[0]),
            "logit_a_minus_b": float(row[tok_a] - row[tok_b])}


def token_agreement(runs: dict, pairs, plain_logits: torch.Tensor, prompt: torch.Tensor, model) -> dict:
    """``{"a vs b": entry}`` for each pair of ``runs`` (name -> ``{"tokens": [...]}``): ``equal``
    and ``first_diff``; where the two part by a token (not one a prefix of the other), both tokens
    and the gaps there, from ``plain_logits`` (the unconverted model over ``hf``'s sequence,
    ``gap_model="unconverted"``) when the prefix is ``hf``'s, else from one forward of ``model``
    (the converted one) over the prefix (``gap_model="converted"``)."""
    P, device = prompt.shape[1], prompt.device
    agreement = {}
    for a, b in pairs:
        sa, sb = runs[a]["tokens"], runs[b]["tokens"]
        d = first_diff(sa, sb)
        entry = {"equal": d is None, "first_diff": d}
        if d is not None and d < min(len(sa), len(sb)):  # else one is a prefix of the other (an end of sequence)
            ta, tb = sa[d], sb[d]
            entry.update({"token_a": ta, "token_b": tb})
            if sa[:d] == runs["hf"]["tokens"][:d]:  # the prefix is hf's: the unconverted model's logits
                entry.update(gap_at(plain_logits, P + d - 1, ta, tb), gap_model="unconverted")
            else:  # ours and ours+lookup parted from hf earlier: the converted model on ours' prefix
                with torch.no_grad():
                    ids = torch.tensor([prompt[0].tolist() + sa[:d]], device=device)
                logits = full_logits(model, ids)
                entry.update(gap_at(logits, P + d - 1, ta, tb), gap_model="converted")
        agreement[f"{a} vs {b}"] = entry
    return agreement
