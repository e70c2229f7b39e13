"""The uniform spec-decode step: verify every layer, accept on the device, commit.

:func:`spec_decode_step` is the body that :class:`ssm_spec.graphs.SpecDecodeGraphRunner` captures per
batch-size bucket and that :func:`ssm_spec.graphs.compile_step` hands to ``torch.compile``. It reads
no value back to the host and allocates nothing whose size depends on data, so one CUDA
graph holds all of it (docs/design.md section 6).
"""

from __future__ import annotations

import torch

from .. import RecoverSSMMetadata, StatePool, commit

from .acceptance import greedy_accept, rejection_sample_accept

__all__ = ["spec_decode_step"]


def spec_decode_step(model, pool: StatePool, window_tokens: torch.Tensor, window_lens: torch.Tensor,
                     state_indices: torch.Tensor, num_computed_tokens: torch.Tensor,
                     query_start_loc: torch.Tensor, draft_probs: torch.Tensor | None = None, *,
                     temperature: float = 1.0, generator: torch.Generator | None = None,
                     pad_token: int = 0, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One uniform spec-decode step for ``B`` rows of ``W`` window tokens.

    Runs ``model(window_tokens.reshape(-1), metadata, pool)`` with the uniform verify metadata
    (:meth:`ssm_spec.RecoverSSMMetadata.uniform_verify`), accepts drafts on the device (greedy
    matching, or speculative rejection sampling when ``draft_probs`` is given) and commits the
    accepted tokens of every recurrent layer (:func:`ssm_spec.commit`).

    Args:
        model: ``model(input_ids [B*W] int64, metadata, pool) -> logits [B*W, vocab]`` (for
            example :class:`ssm_spec.graphs.stack.DecoderStack`).
        pool: the :class:`~ssm_spec.StatePool` of the model's recurrent layers (RecoverSSM or
            snapshot mode).
        window_tokens: ``[B, W]`` int64: the last accepted token, then the drafts.
        window_lens: ``[B]`` int32: real tokens per row, ``1..W`` (``0``: a padding row).
        state_indices: ``[B]`` int32 slots (``NULL_SLOT`` for padding rows).
        num_computed_tokens: ``[B]`` int32 committed tokens per row (``> 0`` for real rows).
        query_start_loc: ``[B + 1]`` int32, ``arange(B + 1) * W``.
        draft_probs: ``[B, W - 1, vocab]`` the draft distributions (absent: greedy).
        temperature, generator: the sampling temperature (``> 0``) and device generator for
            rejection sampling.
        pad_token: filler of unused output positions.
        vocab_size: when given, the logits' width must equal it.

    Returns:
        ``(accepted_tokens [B, W] int64, num_accepted_tokens [B] int32)``: the accepted drafts
        then the bonus token, and ``a + 1`` window tokens committed per row (0 for padding);
        the caller advances ``num_computed_tokens`` by the count.

    Raises:
        ValueError: shapes that do not agree, or ``temperature <= 0`` with ``draft_probs``,
            before the forward; logits narrower or wider than ``vocab_size`` after it. Values
            are the caller's to validate (see :meth:`ssm_spec.graphs.SpecDecodeGraphRunner.step`).
    """
    if window_tokens.dim() != 2:
        raise ValueError(f"spec_decode_step: window_tokens: got shape {list(window_tokens.shape)}; expected [B, W]")
    B, W = window_tokens.shape
    if window_lens.shape != (B,):
        raise ValueError(f"spec_decode_step: window_lens: got shape {list(window_lens.shape)}; expected [{B}]")
    if draft_probs is not None:
        if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, W - 1) or \
                (vocab_size is not None and draft_probs.shape[2] != vocab_size):
            raise ValueError(f"spec_decode_step: draft_probs: got shape {list(draft_probs.shape)}; expected "
                             f"[{B}, {W - 1}, {vocab_size or 'vocab'}]")
        if not temperature > 0:
            raise ValueError(f"spec_decode_step: temperature: got {temperature}; expected > 0")
    metadata = RecoverSSMMetadata.uniform_verify(state_indices, num_computed_tokens, query_start_loc, W)
    logits = model(window_tokens.reshape(-1), metadata, pool).view(B, W, -1)
    if vocab_size is not None and logits.shape[-1] != vocab_size:
        raise ValueError(f"spec_decode_step: the model's logits are {logits.shape[-1]} wide; expected vocab_size "
                         f"= {vocab_size} (raised after the forward: its KV and record buffers are written, the "
                         "committed states are not)")
    if draft_probs is None:
        accepted, counts = greedy_accept(window_tokens, window_lens, logits, pad_token)
    else:
        accepted, counts = rejection_sample_accept(window_tokens, window_lens, logits, draft_probs, temperature,
                                                   generator, pad_token)
    commit(pool, metadata, counts, validate=False)
    return accepted, counts
