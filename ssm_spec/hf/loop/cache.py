"""The decode loop's cache: every row's states in fixed buffers, addressed per row on the device.

:class:`LoopCache` is what a model's forward gets inside the decode loop (docs/design.md
section 7.7). Its attention layers are :class:`RowAttentionLayer` buffers
``[B, kv_heads, N, head_dim]`` written at per-row columns (rows of a batch hold different
lengths after ragged acceptance); its converted GDN layers keep their states in a
:class:`~ssm_spec.StatePool` with one slot per row, verified from that slot read-only and
committed with per-row accepted counts (:func:`ssm_spec.commit`, no host sync). The loop sets the
step before each forward (:meth:`LoopCache.prefill_step` / :meth:`LoopCache.verify_step`); the
layers only follow it.

Columns: row ``b``'s token at column ``c`` of the loop's token buffer sits at column ``c`` of
every attention buffer; left padding occupies columns ``0 .. pad[b] - 1`` and is never attended to.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ...metadata import RecoverSSMMetadata
from ...pools import StatePool
from ...step import commit
from ..adapter import RecoverGDNAdapter
from ..cache import RecoverLinearAttentionLayer

__all__ = ["LoopCache", "RowAttentionLayer"]


class RowAttentionLayer(DynamicLayer):
    """An attention layer's keys and values in ``[B, kv_heads, capacity, head_dim]`` buffers,
    written at per-row columns (``columns [B, L]`` int64 on the device, set by the owner before
    each forward) and returned whole; the forward's mask hides what a query must not see.

    Raises:
        ValueError: from ``update``, a forward whose columns are unset or of another shape.
    """

    is_croppable = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self.columns: torch.Tensor | None = None

    def allocate(self, batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Make the buffers now (zeros ``[batch_size, kv_heads, capacity, head_dim]``), so that a
        compiled or captured forward never makes them: made inside the first compiled call, they
        changed what its guards saw and the next call compiled again, inside the checked warm-up
        of a captured round."""
        self.dtype, self.device = dtype, torch.device(device)
        self.keys = torch.zeros((batch_size, kv_heads, self.capacity, head_dim), dtype=dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.allocate(B, H, D, key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cols = self.columns
        B, _, L, _ = key_states.shape
        if cols is None or tuple(cols.shape) != (B, L):
            raise ValueError(f"RowAttentionLayer: the forward's columns are not set for its {B} rows of {L} tokens "
                             "(the decode loop sets them; call the model through ssm_spec's decode loop)")
        rows = torch.arange(B, device=cols.device)[:, None].expand(B, L)
        self.keys.transpose(1, 2)[rows, cols] = key_states.transpose(1, 2)
        self.values.transpose(1, 2)[rows, cols] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.capacity

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.capacity, 0

    def reset(self) -> None:
        """Keep the buffers (captured graphs point at them); the loop overwrites what it reads."""


class LoopCache(DynamicCache):
    """The cache a model's forward runs with inside the decode loop.

    Args:
        model: a model converted by :func:`~ssm_spec.hf.apply_recoverssm`, or a model without
            GatedDeltaNet layers (an attention-only assistant).
        batch_size: rows (a batch bucket: rows past the real ones are padding).
        capacity: token columns of every attention buffer (prompt, new tokens and one window).
        max_window: the longest window a verify step of this cache runs (sizes the records).
        state_dtype / mode: the recurrent states' dtype and the verify mode (the model's
            :class:`~ssm_spec.hf.RecoverSSMConfig`).

    The GDN states (one :class:`~ssm_spec.StatePool` slot per row) live on the device of the
    model's embeddings; the loop serves models on one device.
    """

    #: recognised by the converted layers (:class:`~ssm_spec.hf.adapter.RecoverGDNAdapter`)
    rolls_back_linear_attention = True

    def __init__(self, model, batch_size: int, capacity: int, max_window: int, *, state_dtype=torch.float32,
                 mode: str = "exact"):
        config = model.config.get_text_config(decoder=True)
        super().__init__(config=config)
        self.adapters = [m for m in model.modules() if isinstance(m, RecoverGDNAdapter)]
        linear = {a.layer_idx for a in self.adapters}
        for i in range(len(self.layers)):
            self.layers[i] = RecoverLinearAttentionLayer(self) if i in linear else RowAttentionLayer(capacity)
        self.attention_layers = [layer for layer in self.layers if isinstance(layer, RowAttentionLayer)]
        self.num_rows, self.capacity, self.max_window = int(batch_size), int(capacity), int(max_window)
        weight = model.get_input_embeddings().weight
        self.device = weight.device
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for layer in self.attention_layers:
            layer.allocate(self.num_rows, kv_heads, head_dim, weight.dtype, self.device)
        self.pool = None
        if self.adapters:
            self.pool = StatePool(self.adapters, num_slots=self.num_rows, max_tokens=self.num_rows * self.max_window,
                                  dtype=state_dtype, conv_dtype=weight.dtype, device=self.device, mode=mode)
        self._slots = torch.arange(self.num_rows, dtype=torch.int32, device=self.device)
        self._step = None  # ("prefill", valid columns [B, L]) or ("verify", metadata)

    # ------------------------------------------------------------------ steps
    def reset_states(self) -> None:
        """Zero every row's GDN states (a new sequence in every row)."""
        if self.pool is not None:
            self.pool.zero_slots(self._slots)

    def set_columns(self, columns: torch.Tensor) -> None:
        """The columns ``[B, L]`` int64 this forward's tokens go to in every attention buffer."""
        for layer in self.attention_layers:
            layer.columns = columns

    def prefill_step(self, columns: torch.Tensor, valid: torch.Tensor) -> None:
        """The next forward prefills every row's ``L`` columns from the zero state; ``valid [B, L]``
        bool marks each row's real tokens (left padding and padding rows ``False``). On the device,
        no host read: the converted layers run
        :meth:`~ssm_spec.RecoverGatedDeltaNet.prefill_padded`."""
        self.set_columns(columns)
        self._step = None if self.pool is None else ("prefill", valid)

    def verify_step(self, metadata: RecoverSSMMetadata, columns: torch.Tensor) -> None:
        """The next forward verifies every row's window from its slot (``metadata``: built on the
        device by the loop, :meth:`~ssm_spec.RecoverSSMMetadata.uniform_verify`)."""
        self.set_columns(columns)
        self._step = ("verify", metadata)

    def verify_metadata(self, active: torch.Tensor, window: int) -> RecoverSSMMetadata:
        """The uniform verify step of ``window`` tokens per row; inactive rows are padding rows
        (null slot: their states are neither read nor written). On the device, no host read."""
        B = self.num_rows
        slots = torch.where(active, self._slots, torch.full_like(self._slots, -1))
        qsl = torch.arange(B + 1, dtype=torch.int32, device=self.device) * window
        return RecoverSSMMetadata.uniform_verify(slots, torch.ones_like(self._slots), qsl, window)

    def commit(self, metadata: RecoverSSMMetadata, num_accepted_tokens: torch.Tensor) -> None:
        """Keep each row's first ``num_accepted_tokens[b]`` window tokens of the last verify
        (``[B]`` int32 on the device; 0 for padding rows): one grouped commit per state group."""
        if self.pool is not None:
            commit(self.pool, metadata, num_accepted_tokens, validate=False)

    # ------------------------------------------------------------------ the converted layers' call
    def linear_forward(self, adapter, hidden: torch.Tensor) -> torch.Tensor:
        """Run a converted layer over ``hidden [B, L, D]`` as the current step says."""
        if self._step is None:
            raise ValueError("LoopCache: a converted layer ran outside a step of the decode loop")
        B, L, D = hidden.shape
        if self._step[0] == "verify":
            return adapter.engine_forward(hidden.reshape(B * L, D), self._step[1], self.pool).view(B, L, D)
        return adapter.prefill_padded(hidden, self._step[1], self.pool, self._slots)

    # ------------------------------------------------------------------ transformers' cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def crop(self, max_length) -> None:
        raise ValueError("LoopCache: the decode loop keeps its rows' lengths itself; it is not cropped")
