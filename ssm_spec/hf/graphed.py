"""``GraphedForward``: a converted model's decode and verify forwards replayed as CUDA graphs.

At batch 1 a forward of a 0.5 B model launches ~550 kernels from transformers' Python code and
ours, and the host takes 10-20 ms to do so while the kernels need ~1.3 ms (docs/perf-notes.md):
``generate`` is host-bound, and a speculative round gains only its accepted length. Capture
removes the host from the step, as engines do (docs/design.md section 6); this brings it to
Hugging Face's ``generate`` without changing transformers:

* the cache's attention layers are :class:`~ssm_spec.hf.static_kv.StaticAttentionLayer`
  (buffers allocated once, written at positions held in a device tensor), its GDN layers the
  :class:`~ssm_spec.hf.rollback.RollbackPool` (slots and record buffers allocated once; the
  forward's metadata cached per shape);
* the host work of a forward (the rollback plan, commits of retired tokens, positions) runs
  eagerly before the model; the model itself runs with explicit ``position_ids`` and a
  ready-made attention mask (``{"full_attention": [1, 1, L, max_cache_len] mask,
  "linear_attention": None}``, the mask mapping transformers' Qwen3-Next / Qwen3.5 models
  accept), so nothing in it depends on a host integer that changes between steps;
* a forward of ``L`` tokens that only verifies (every forward after the prompt, up to the
  cache's ``max_pending`` tokens, at most ``MAX_CAPTURE_TOKENS``) is captured once per
  ``(L, plan)`` into one graph memory pool and replayed afterwards; the prompt forward
  (chunked prefill), and anything off CUDA, runs the same body eagerly.

Capture first runs the forward eagerly on a side stream with host syncs turned into errors; a
model that synchronises (for example a mixture-of-experts layer that routes on the host) or
that CUDA graphs cannot hold falls back to eager forwards with one warning, never to wrong
results. Replaying is exact: the graph runs the same kernels on the same inputs as the eager
body (tests/hf/test_graphs.py compares them token for token on the GPU).
"""

from __future__ import annotations

import traceback
import warnings
from dataclasses import dataclass

import torch

from ..capture import CaptureError, GraphCapture
from .placement import placement_problem
from .static_kv import StaticAttentionLayer

__all__ = ["GraphedForward", "SUPPORTED_ATTENTION"]

#: Forwards of more tokens than this run eagerly (a prompt fed without prefill, an assistant's
#: long draft): each token count is a graph of its own, worth keeping only for the short ones.
MAX_CAPTURE_TOKENS = 64

#: Attention implementations whose mask format the graphed forward builds.
SUPPORTED_ATTENTION = ("sdpa", "eager")

# keyword arguments generate passes that the graphed forward accounts for itself
_HANDLED = {"input_ids", "attention_mask", "position_ids", "cache_position", "use_cache", "return_dict",
            "logits_to_keep", "past_key_values", "cache"}
# keyword arguments that may be passed with these values and change nothing
_NEUTRAL = {"output_attentions": (None, False), "output_hidden_states": (None, False), "inputs_embeds": (None,),
            "token_type_ids": (None,), "labels": (None,)}


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [B, L] int64, static
    position_ids: torch.Tensor  # the rotary positions as passed (or [1, L]), static
    kv_positions: torch.Tensor  # [L] int64: cache rows written, static
    logits: torch.Tensor  # [B, L, vocab], static output


class GraphedForward:
    """Runs every forward of a :class:`~ssm_spec.hf.RecoverSSMCache` built with
    ``max_cache_len``: eagerly for prompts, from captured CUDA graphs for verify forwards.

    Args:
        cache: the cache (its attention layers are :class:`StaticAttentionLayer`).

    Attributes:
        static_layers: the cache's :class:`StaticAttentionLayer` entries.
        capture: capture and replay CUDA graphs (default ``True``; ``False`` runs every
            forward eagerly on the same static buffers, for comparisons).
        graphs: ``{(batch, tokens, id(plan), position_ids shape): _Graph}`` captured on the
            current rollback pool (cleared when the pool or the batch size changes).
        failed: why capture was abandoned for this cache (``None`` while it works), with the
            innermost frames of the failing call.
        replays / eager_forwards: forwards served each way (for reports and tests).
        capturable_forwards: forwards whose shape and arguments allow capture, on any device
            (on CUDA these are the replays, unless capture failed or is off).
    """

    def __init__(self, cache):
        self.cache = cache
        self.static_layers = [layer for layer in cache.layers if isinstance(layer, StaticAttentionLayer)]
        self.capture = True
        self.graphs: dict = {}
        self._capturer: GraphCapture | None = None
        self.failed: str | None = None
        self.replays = 0
        self.eager_forwards = 0
        self.capturable_forwards = 0
        self._arange: torch.Tensor | None = None
        self._output_type = None
        self._output_cache_field = None
        self._owner = None  # (rollback, its StatePool) the graphs were captured on

    def __deepcopy__(self, memo):
        """A copy (of a copied cache) starts without graphs: they point at the original's buffers."""
        from copy import deepcopy

        new = GraphedForward(deepcopy(self.cache, memo))
        new.capture, new.failed = self.capture, self.failed
        return new

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def __call__(self, model, kwargs: dict):
        """One forward of ``model`` (keyword arguments as transformers' ``forward`` takes them).

        ``input_ids [B, L]`` int64 is required. Keys and values go to cache rows
        ``seen .. seen + L - 1`` and each token attends to the rows up to its own (as
        transformers' growing cache does); ``position_ids`` (as passed, else those rows) feed
        the rotary embedding. An ``attention_mask`` must mark no padding (checked on the first
        forward, where it is all the mask there is; later forwards only append). Forwards that
        ask for more than logits (``output_hidden_states``, ``labels``, ...) run eagerly and
        return everything the model returns.

        Returns:
            the model's output (``return_dict=False``: its tuple) with ``logits [B, L', vocab]``
            (``L'`` as ``logits_to_keep`` asks) and the cache; replayed logits are a fresh
            tensor.

        Raises:
            ValueError: ``inputs_embeds`` instead of ``input_ids``; padding in the attention
                mask; more tokens than the cache's ``max_cache_len``; an attention
                implementation other than sdpa / eager; a batch size other than the cache's
                mid-sequence; ``position_ids`` whose last dim is not ``L``. Raised before
                anything changes.
        """
        cache = self.cache
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("GraphedForward: needs input_ids (inputs_embeds is not supported with cuda_graphs)")
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(f"GraphedForward: attention implementation {impl!r}; cuda_graphs supports "
                             f"{SUPPORTED_ATTENTION}")
        B, L = input_ids.shape
        seen = cache.get_seq_length()
        if seen + L > cache.kv_capacity:
            raise ValueError(f"GraphedForward: {seen} cached + {L} new tokens exceed max_cache_len "
                             f"{cache.kv_capacity}; create the RecoverSSMCache with a larger max_cache_len")
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if isinstance(mask, dict) or mask.dim() != 2 or mask.shape[-1] != seen + L:
                raise ValueError("GraphedForward: expected a 2-D attention mask over the cached and new tokens")
            if seen == 0 and not bool(mask.all()):
                raise ValueError("GraphedForward: padding in the attention mask is not supported with cuda_graphs "
                                 "(pass unpadded rows, or convert without cuda_graphs)")
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and position_ids.shape[-1] != L:
            raise ValueError(f"GraphedForward: position_ids {tuple(position_ids.shape)} for {L} tokens")
        rb = cache.rollback
        if rb is not None and rb.batch_size != B and rb.seen:
            raise ValueError(f"GraphedForward: batch size changed from {rb.batch_size} to {B} mid-sequence")
        self._fit_batch(B)
        extra = {k: v for k, v in kwargs.items() if k not in _HANDLED}
        plain = all(k in _NEUTRAL and v in _NEUTRAL[k] for k, v in extra.items())
        keep = kwargs.get("logits_to_keep")
        keep = 0 if keep is None else keep
        cache.begin_forward(B, L, model.get_input_embeddings().weight.dtype, input_ids.device)
        out = None
        try:
            rb = cache.rollback
            if self._owner is None or self._owner[0] is not rb or self._owner[1] is not rb.pool:
                self._drop_graphs()  # captured on buffers that are gone
                self._owner = (rb, rb.pool)
            plan = rb.plan
            kv_positions = self._positions(seen, L, input_ids.device)
            capturable = plain and plan.prefill is None and L <= MAX_CAPTURE_TOKENS
            self.capturable_forwards += capturable
            if capturable and self.capture and input_ids.is_cuda and self.failed is None:
                logits = self._replay(model, input_ids, position_ids, kv_positions, plan)
                if logits is not None:
                    logits = logits[:, -keep:] if isinstance(keep, int) and keep > 0 else (
                        logits if isinstance(keep, int) else logits[:, keep])
                    out = self._output_type(logits=logits, **{self._output_cache_field: cache})
            if out is None:
                self.eager_forwards += 1
                out = self._body(model, input_ids, position_ids, kv_positions, extra, keep)
        finally:  # the plan is begun: the attention layers hold these tokens too, as the GDN ones do
            cache.end_forward()
            for layer in self.static_layers:
                layer.length = seen + L
        return out.to_tuple() if kwargs.get("return_dict") is False else out

    # ------------------------------------------------------------------ the forward body
    def _drop_graphs(self) -> None:
        """Forget the captured graphs and their memory pool (a pool whose graphs are all gone is
        freed by the allocator; capturing into its old handle again trips an internal assert)."""
        self.graphs.clear()
        if self._capturer is not None:
            self._capturer.reset()

    def _fit_batch(self, B: int) -> None:
        """At the start of a sequence, re-size static buffers held for another batch size (beam
        search and ``num_return_sequences`` expand the batch inside ``generate``)."""
        for layer in self.static_layers:
            if layer.is_initialized and layer.keys.shape[0] != B:
                layer.is_initialized = False  # allocated again by the next update
                self._drop_graphs()

    def _mask(self, model, kv_positions: torch.Tensor) -> torch.Tensor:
        """``[1, 1, L, max_cache_len]``: query ``i`` sees cache rows ``0 .. kv_positions[i]``
        (bool for sdpa, additive for the eager implementation)."""
        allowed = self._arange[None, None, None, :] <= kv_positions[None, None, :, None]
        if getattr(model.config, "_attn_implementation", None) == "sdpa":
            return allowed
        dtype = model.get_input_embeddings().weight.dtype
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return zero.masked_fill(~allowed, torch.finfo(dtype).min)

    def _body(self, model, input_ids, position_ids, kv_positions, extra=None, logits_to_keep=0):
        """The model on explicit positions and mask (``position_ids=None``: the cache rows)."""
        cache = self.cache  # its forward is open (__call__): the converted layers run in it
        for layer in self.static_layers:
            layer.write_index = kv_positions
        try:
            mask = {"full_attention": self._mask(model, kv_positions), "linear_attention": None}
            key = model._recoverssm.cache_kwarg
            pos = kv_positions[None] if position_ids is None else position_ids
            out = type(model).forward(model, input_ids=input_ids, position_ids=pos, attention_mask=mask,
                                      use_cache=True, logits_to_keep=logits_to_keep, return_dict=True,
                                      **{key: cache}, **(extra or {}))
        finally:
            for layer in self.static_layers:
                layer.write_index = None  # a call that bypasses this forward finds no stale positions
        if self._output_type is None:
            self._output_type = type(out)
            self._output_cache_field = next(k for k, v in out.items() if v is cache)
        return out

    def _positions(self, seen: int, L: int, device) -> torch.Tensor:
        """Cache rows ``seen .. seen + L - 1`` (``[L]`` int64, a view of a device arange)."""
        if self._arange is None or self._arange.device != device:
            self._arange = torch.arange(self.cache.kv_capacity, device=device)
        return self._arange[seen:seen + L]

    # ------------------------------------------------------------------ capture and replay
    def _replay(self, model, input_ids, position_ids, kv_positions, plan):
        B, L = input_ids.shape
        shape = None if position_ids is None else tuple(position_ids.shape)
        key = (B, L, id(plan), shape)  # plans live as long as their rollback pool, which owns the graphs
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(model, input_ids, position_ids, kv_positions)
            if entry is None:
                return None
            self.graphs[key] = entry
        else:
            entry.input_ids.copy_(input_ids)
            entry.kv_positions.copy_(kv_positions)
            if position_ids is not None:
                entry.position_ids.copy_(position_ids)
        entry.graph.replay()
        self.replays += 1
        return entry.logits.clone()

    def _capture(self, model, input_ids, position_ids, kv_positions):
        """Warm up (host syncs raise), capture and return the graph of this forward, or ``None``
        after a warning when the model cannot be captured (``failed`` says why): a model whose
        placement a graph cannot hold (several devices, offloaded weights: a device map) is
        refused before anything runs."""
        problem = placement_problem(model)
        if problem is not None:
            self.failed = f"{problem}; a CUDA graph holds the forward of one device with resident weights"
            warnings.warn(f"apply_recoverssm(cuda_graphs=True): {self.failed}; running eagerly.", RuntimeWarning,
                          stacklevel=4)
            return None
        static_ids = input_ids.clone()
        static_kv = kv_positions.clone()
        static_pos = None if position_ids is None else position_ids.clone()
        if self._capturer is None or self._capturer.device != input_ids.device:
            self._capturer = GraphCapture(input_ids.device, "apply_recoverssm(cuda_graphs=True)")
        try:  # the warm-up is a real forward: it writes what the replay will
            self._capturer.warmup(lambda: self._body(model, static_ids, static_pos, static_kv), what="a forward")
            graph, out = self._capturer.capture(lambda: self._body(model, static_ids, static_pos, static_kv),
                                               what="a forward")
        except CaptureError as exc:
            frames = traceback.extract_tb((exc.__cause__ or exc).__traceback__)[-4:]
            where = "; ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames)
            self.failed = f"{exc} (at {where})"
            warnings.warn("apply_recoverssm(cuda_graphs=True): this model's forward cannot be captured (it "
                          f"synchronises with the host or runs what CUDA graphs cannot hold); running eagerly. "
                          f"{self.failed}", RuntimeWarning, stacklevel=4)
            return None
        return _Graph(graph, static_ids, static_pos, static_kv, out.logits)
