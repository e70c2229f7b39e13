"""``RecoverGDNAdapter``: takes transformers' batched GDN call and runs a RecoverGatedDeltaNet.

transformers calls a Qwen3-Next / Qwen3.5 GatedDeltaNet as
``linear_attn(hidden_states [B, L, hidden], cache=..., attention_mask=...)`` (``cache_params=``
before transformers 5.2x). The adapter zeroes padded positions as transformers does
(``apply_mask_to_padding_states``), then hands the rows to the cache's rollback pool, which
runs the wrapped :class:`~ssm_spec.RecoverGatedDeltaNet` with the forward's metadata.
"""

from __future__ import annotations

import torch
from torch import nn

from ..metadata import RecoverSSMMetadata
from ..modules import RecoverGatedDeltaNet
from ..pools import StatePool

__all__ = ["RecoverGDNAdapter"]


class RecoverGDNAdapter(nn.Module):
    """Stands in for a Hugging Face GDN layer; shares its weights through ``inner``.

    Args:
        inner: the :class:`~ssm_spec.RecoverGatedDeltaNet` (``from_hf`` of the HF layer).
        layer_idx: the decoder layer's index (the cache entry it owns).

    Forward: ``hidden_states [B, L, hidden]`` -> ``[B, L, hidden]`` in the input dtype. With a
    :class:`~ssm_spec.hf.RecoverSSMCache` the states persist and roll back; with no cache
    (``use_cache=False``) each call is a standalone prefill from the zero state.

    Raises:
        ValueError: a cache that is not a ``RecoverSSMCache`` (transformers' own cache cannot
            roll back a recurrent state).
    """

    def __init__(self, inner: RecoverGatedDeltaNet, layer_idx: int):
        super().__init__()
        self.inner = inner
        self.layer_idx = int(layer_idx)

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                cache_params=None, **kwargs) -> torch.Tensor:
        from .cache import RecoverSSMCache

        cache = cache if cache is not None else cache_params
        if attention_mask is not None and attention_mask.dim() == 2:  # zero the padded positions, as HF does
            hidden_states = (hidden_states * attention_mask[:, -hidden_states.shape[1]:, None]).to(hidden_states.dtype)
        with torch.no_grad():
            if cache is None:
                return self._standalone(hidden_states)
            if not isinstance(cache, RecoverSSMCache):
                raise ValueError(f"{type(self).__name__}: got a {type(cache).__name__}; a converted model needs a "
                                 "ssm_spec.hf.RecoverSSMCache (generate() and forward() create one when none is given)")
            return cache.linear_forward(self, hidden_states)

    def _standalone(self, hidden: torch.Tensor) -> torch.Tensor:
        B, L, D = hidden.shape
        pool = StatePool([self.inner], num_slots=B, max_tokens=1, conv_dtype=hidden.dtype, device=hidden.device)
        md = RecoverSSMMetadata.build([L] * B, [True] * B, [0] * B, list(range(B)), num_slots=B, device=hidden.device)
        return self.inner(hidden.reshape(B * L, D), md, pool).view(B, L, D)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"
