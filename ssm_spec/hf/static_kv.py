"""``StaticAttentionLayer``: an attention layer's KV cache in a buffer allocated once.

transformers' ``DynamicLayer`` grows its keys and values by concatenation, so every forward
allocates and the tensors attention reads move: a CUDA graph cannot hold it. This layer keeps
``[B, kv_heads, max_cache_len, head_dim]`` buffers, writes a forward's keys and values at the
positions the cache gives it (a device tensor, so a captured forward writes where the current
replay says) and returns the whole buffers; the forward's attention mask hides the positions
past each query (:mod:`ssm_spec.hf.graphed` builds it). A crop only lowers the length: the
rows past it are overwritten by the next forward and never attended to before that.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["StaticAttentionLayer"]


class StaticAttentionLayer(DynamicLayer):
    """A full-attention layer's cache entry with a fixed capacity of ``max_cache_len`` tokens.

    ``length`` (host int) is the number of tokens held; the owner (the graphed forward of
    :class:`~ssm_spec.hf.RecoverSSMCache`) sets ``write_index`` (``[L]`` int64, on the device)
    before each forward and advances ``length`` after it, so that a replayed CUDA graph, which
    runs no Python, keeps the same bookkeeping as an eager forward.

    Raises:
        ValueError: from ``update``, a forward whose ``write_index`` is unset or of another
            length than its tokens; from ``crop``, a crop below zero tokens.
    """

    is_croppable = True

    def __init__(self, max_cache_len: int):
        super().__init__()
        self.max_cache_len = int(max_cache_len)
        self.length = 0
        self.write_index: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys = torch.zeros((B, H, self.max_cache_len, D), dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros((B, H, self.max_cache_len, value_states.shape[-1]), dtype=value_states.dtype,
                                  device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states / value_states [B, kv_heads, L, head_dim]`` at ``write_index`` and
        return the whole buffers ``[B, kv_heads, max_cache_len, head_dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        idx = self.write_index
        if idx is None or idx.shape[0] != key_states.shape[-2]:
            raise ValueError("StaticAttentionLayer: the forward's write positions are not set for its "
                             f"{key_states.shape[-2]} tokens; call the model through its RecoverSSMCache's "
                             "graphed forward (apply_recoverssm(model, cuda_graphs=True))")
        if idx.device != self.keys.device:  # a layer on another device than the inputs (a device map; eager)
            idx = idx.to(self.keys.device)
        self.keys.index_copy_(2, idx, key_states)
        self.values.index_copy_(2, idx, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def crop(self, max_length: int) -> None:
        """``max_length <= 0``: remove the last ``-max_length`` tokens; otherwise keep the first
        ``max_length`` (transformers' two conventions)."""
        m = int(max_length)
        new = self.length + m if m <= 0 else min(self.length, m)
        if new < 0:
            raise ValueError(f"StaticAttentionLayer.crop: cannot remove {-m} of {self.length} tokens")
        self.length = new

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            idx = beam_idx.to(self.keys.device)
            self.keys.copy_(self.keys.index_select(0, idx))
            self.values.copy_(self.values.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("StaticAttentionLayer: a static cache cannot change its batch size")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("StaticAttentionLayer: a static cache cannot change its batch size")

    def reset(self) -> None:
        """Forget the tokens (the buffers stay allocated, so captured graphs stay valid)."""
        self.length = 0
