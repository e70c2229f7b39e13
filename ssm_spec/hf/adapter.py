"""``RecoverGDNAdapter``: a RecoverGatedDeltaNet that takes transformers' batched GDN call.

transformers calls a Qwen3-Next / Qwen3.5 GatedDeltaNet as
``linear_attn(hidden_states [B, L, hidden], cache=..., attention_mask=...)`` (``cache_params=``
before transformers 5.2x). The adapter is the layer itself (a
:class:`~ssm_spec.RecoverGatedDeltaNet` built by ``from_hf``, so it holds Hugging Face's
submodules under their own names and a converted model saves and loads as the original); its
forward zeroes padded positions as transformers does (``apply_mask_to_padding_states``) and
hands the rows to the cache's rollback pool, which runs :meth:`engine_forward` with the
forward's metadata.

This module does not import :mod:`ssm_spec.hf.cache` (the cache imports it, to find the
converted layers): it recognises a RecoverSSM cache by its ``rolls_back_linear_attention``
class attribute, so the two modules do not import each other.
"""

from __future__ import annotations

import torch
from torch import nn

from ..metadata import RecoverSSMMetadata
from ..modules import RecoverGatedDeltaNet
from ..pools import StatePool
from .placement import hook_loaded

__all__ = ["RecoverGDNAdapter"]


class RecoverGDNAdapter(RecoverGatedDeltaNet):
    """Stands in for a Hugging Face GDN layer, sharing its parameters and submodules.

    Build it with ``RecoverGDNAdapter.from_hf(hf_layer)`` (``layer_idx`` is the HF layer's).

    Forward: ``hidden_states [B, L, hidden]`` -> ``[B, L, hidden]`` in the input dtype. With a
    :class:`~ssm_spec.hf.RecoverSSMCache` the states persist and roll back; with no cache
    (``use_cache=False``) each call is a standalone prefill from the zero state. Inference only,
    like every RecoverSSM layer: call it under ``torch.no_grad()`` (``generate`` does).

    Raises:
        ValueError: a cache that is not a ``RecoverSSMCache`` (transformers' own cache cannot
            roll back a recurrent state); grad mode with parameters that require grad.
    """

    # The engine call (flat tokens [T, hidden], metadata, pool); a forward makes it once or twice
    # (its prefill part, its verify part). It reads conv1d.weight without calling conv1d: under a
    # device map that offloads it, forward() has its accelerate hook load it once for both.
    engine_forward = RecoverGatedDeltaNet.forward

    @classmethod
    def from_hf(cls, module: nn.Module, tp_group=None) -> RecoverGDNAdapter:
        self = super().from_hf(module, tp_group=tp_group)
        self.layer_idx = int(module.layer_idx)
        return self

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                cache_params=None, **kwargs) -> torch.Tensor:
        if self.conv1d.__dict__.get("_hf_hook") is None:  # accelerate keeps hooks in the instance dict
            return self._forward(hidden_states, cache, attention_mask, cache_params)
        with hook_loaded(self.conv1d):  # an offloaded conv weight, loaded once per forward
            return self._forward(hidden_states, cache, attention_mask, cache_params)

    def _forward(self, hidden_states, cache, attention_mask, cache_params) -> torch.Tensor:
        cache = cache if cache is not None else cache_params
        if attention_mask is not None and attention_mask.dim() == 2:  # zero the padded positions, as HF does
            hidden_states = (hidden_states * attention_mask[:, -hidden_states.shape[1]:, None]).to(hidden_states.dtype)
        if cache is None:
            return self._standalone(hidden_states)
        if not getattr(type(cache), "rolls_back_linear_attention", False):  # a RecoverSSMCache (or subclass)
            raise ValueError(f"{type(self).__name__}: got a {type(cache).__name__}; a converted layer needs a "
                             "ssm_spec.hf.RecoverSSMCache (generate() and forward() of the converted model create "
                             "one; when calling the base model, pass cache=RecoverSSMCache(model))")
        return cache.linear_forward(self, hidden_states)

    def _standalone(self, hidden: torch.Tensor) -> torch.Tensor:
        B, L, D = hidden.shape
        pool = StatePool([self], num_slots=B, max_tokens=1, conv_dtype=hidden.dtype, device=hidden.device)
        md = RecoverSSMMetadata.build([L] * B, [True] * B, [0] * B, list(range(B)), num_slots=B, device=hidden.device)
        return self.engine_forward(hidden.reshape(B * L, D), md, pool).view(B, L, D)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, layout={self.layout}"
