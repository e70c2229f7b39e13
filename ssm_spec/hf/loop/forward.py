"""A Hugging Face causal LM's forward as the decode loop runs it: explicit per-row columns,
positions and masks over fixed buffers (:class:`~ssm_spec.hf.loop.cache.LoopCache`).

A query at column ``q`` of row ``b`` attends to the row's columns ``pad[b] .. q`` (a padding
column attends to itself only, so no softmax row is empty); its rotary position is
``q - pad[b]``, the position the row has in a batch of its own.
"""

from __future__ import annotations

import functools

import torch

from ..config import cache_kwarg
from ..narrow_gemv import inductor_forms
from .cache import LoopCache

__all__ = ["LoopModel", "SUPPORTED_ATTENTION", "row_mask", "compiled"]

#: Attention implementations whose mask format the loop builds.
SUPPORTED_ATTENTION = ("sdpa", "eager")

#: Compiled graphs of the verify forward kept at once (dynamo's recompile limit while it runs):
#: one per model, batch bucket and window width, all of one code object (``LoopModel._forward``),
#: where dynamo's default of 8 ends a process's ninth shape with an error under ``fullgraph``.
COMPILED_SHAPES_LIMIT = 256


def compiled(fn):
    """``fn`` through ``torch.compile(fullgraph=True, dynamic=False)`` (inductor), run with
    dynamo's recompile limit at :data:`COMPILED_SHAPES_LIMIT` (one static graph per shape it
    meets) and inside :func:`~ssm_spec.hf.narrow_gemv.inductor_forms` (the narrow projections'
    one-row GEMV in inductor's form)."""
    limit = torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES_LIMIT,
                                       accumulated_recompile_limit=4 * COMPILED_SHAPES_LIMIT)
    inner = limit(torch.compile(fn, fullgraph=True, dynamic=False))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with inductor_forms():
            return inner(*args, **kwargs)

    return run


def row_mask(arange: torch.Tensor, columns: torch.Tensor, pad: torch.Tensor, sdpa: bool, dtype: torch.dtype):
    """The attention mask of queries at ``columns [B, L]`` over ``arange [N]`` buffer columns:
    row ``b``'s columns ``pad[b] .. q`` (and the query's own column, so a padding query's softmax
    row is not empty). ``[B, 1, L, N]``: bool for sdpa, else additive in ``dtype``."""
    c = arange[None, None, None, :]
    q = columns[:, None, :, None]
    allowed = ((c >= pad[:, None, None, None]) & (c <= q)) | (c == q)
    if sdpa:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return zero.masked_fill(~allowed, torch.finfo(dtype).min)


class LoopModel:
    """One model (the target or an assistant) inside the decode loop.

    Args:
        model: the Hugging Face causal LM (converted, or without GatedDeltaNet layers).
        batch_size / capacity / max_window / state_dtype / mode: its :class:`LoopCache`'s.
        compile: verify forwards run through ``torch.compile(fullgraph=True, dynamic=False)``
            (inductor fuses what surrounds the ops; the prompt's prefill is not compiled): one graph
            per batch bucket and window width, the graph each shape's capture records (the
            pool's buffers are static to dynamo as well: :class:`~ssm_spec.StatePool`).
    """

    def __init__(self, model, batch_size: int, capacity: int, max_window: int, *, state_dtype=torch.float32,
                 mode: str = "exact", compile: bool = False):
        self.model = model
        self.cache = LoopCache(model, batch_size, capacity, max_window, state_dtype=state_dtype, mode=mode)
        self.key = cache_kwarg(model)
        self._base_key = cache_kwarg(model.base_model)
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        self.sdpa = impl == "sdpa"
        self.dtype = model.get_input_embeddings().weight.dtype
        self.dict_mask = bool(self.cache.adapters)  # the hybrid decoders take a mask per layer type
        self._arange = torch.arange(capacity, device=self.cache.device)
        # a plain function, called with self: a bound method kept on self would be a reference
        # cycle, and a replaced loop's buffers would outlive it until a garbage-collection pass
        self._verify_forward = compiled(LoopModel._forward) if compile else LoopModel._forward

    def _mask(self, columns: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return row_mask(self._arange, columns, pad, self.sdpa, self.dtype)

    def _forward(self, tokens: torch.Tensor, columns: torch.Tensor, pad: torch.Tensor, keep: int,
                 hidden: bool = False):
        mask = self._mask(columns, pad)
        if self.dict_mask:
            mask = {"full_attention": mask, "linear_attention": None}
        kwargs = dict(input_ids=tokens, position_ids=columns - pad[:, None], attention_mask=mask, use_cache=True,
                      return_dict=True)
        if hidden:  # the base model and the LM head, as the model's own forward runs them, keeping the hidden states
            base = self.model.base_model
            h = base(**kwargs, **{self._base_key: self.cache}).last_hidden_state
            return self.model.get_output_embeddings()(h[:, -keep:] if keep else h), h
        out = type(self.model).forward(self.model, logits_to_keep=keep, **kwargs, **{self.key: self.cache})
        return out.logits

    def prefill(self, rows, width: int, hidden: bool = False):
        """Feed each row's first ``width`` columns from the zero state: its real tokens are those
        from ``rows.pad[b]`` on (padding rows, ``rows.finished``, have none). Returns the last
        column's logits ``[B, 1, V]`` (``None`` when ``width`` is 0: nothing to feed), and with
        ``hidden`` the final-norm hidden states of every column, ``(logits, [B, width, H])``.
        Fixed shapes and no host reads: a CUDA graph holds it (one per width)."""
        self.cache.reset_states()
        if width == 0:
            return (None, None) if hidden else None
        B = rows.batch_size
        columns = rows.columns[:width][None, :].expand(B, width)
        valid = (columns >= rows.pad[:, None]) & ~rows.finished[:, None]
        self.cache.prefill_step(columns, valid)
        return self._forward(rows.tokens[:, :width], columns, rows.pad, keep=1, hidden=hidden)

    def verify(self, tokens: torch.Tensor, columns: torch.Tensor, rows, active: torch.Tensor, hidden: bool = False):
        """One verify forward of ``tokens [B, W]`` at ``columns [B, W]`` from each active row's
        state (read only); returns ``(logits [B, W, V], the step's metadata)`` for
        :meth:`commit`, and with ``hidden`` also the hidden states after the final norm
        ``[B, W, H]`` (the MTP head's input): ``(logits, metadata, hidden)``."""
        md = self.cache.verify_metadata(active, tokens.shape[1])
        self.cache.verify_step(md, columns)
        if hidden:
            logits, h = self._verify_forward(self, tokens, columns, rows.pad, 0, True)
            return logits, md, h
        return self._verify_forward(self, tokens, columns, rows.pad, keep=0), md

    def commit(self, metadata, num_accepted_tokens: torch.Tensor) -> None:
        """Keep each row's first ``num_accepted_tokens[b]`` tokens of that verify."""
        self.cache.commit(metadata, num_accepted_tokens.to(torch.int32))
