"""``RecoverSSMCache``: a transformers ``DynamicCache`` whose linear-attention layers roll back.

Attention layers keep transformers' own ``DynamicLayer`` behaviour. The linear-attention
entries are placeholders (:class:`RecoverLinearAttentionLayer`, so transformers' ``is_linear``
and sequence-length fallbacks keep working); the states of every GDN layer live in one
:class:`~ssm_spec.hf.rollback.RollbackPool`, driven by the converted layers' forwards and by
``crop`` (docs/design.md section 7.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, LinearAttentionLayer

from .._backref import BackRef
from .adapter import RecoverGDNAdapter
from .config import check_mode, check_state_dtype
from .placement import layer_devices
from .rollback import RollbackPool
from .static_kv import StaticAttentionLayer

__all__ = ["RecoverSSMCache", "RecoverLinearAttentionLayer", "AcceptanceStats"]


@dataclass
class AcceptanceStats:
    """Drafts verified and accepted by a target model, one entry per speculative round.

    A round is one forward of the last token plus ``d`` drafts followed by a crop that removes
    the rejected ones. ``offered[i]`` counts rounds that had a draft at position ``i``,
    ``per_position[i]`` those that accepted it. Accepted means the target agreed with the draft
    (the drafter's quality): a last round cut at an EOS keeps fewer tokens, so
    ``rounds * mean_accepted_length`` can exceed the new tokens.

    The two loops count alike except at the edges of a call. ssm-spec's decode loop makes the
    first new token in the prompt's forward (not a round) and counts only drafts inside each
    row's token budget (its fixed-width window may hold more in a row's last round), so without
    an EOS ``rounds + accepted`` is the new tokens less one. transformers' loop verifies its
    first drafts in the prompt's forward (a round), and its candidate generators may propose past
    the budget (5.25's prompt lookup does), which are counted as proposed.
    """

    rounds: int = 0
    empty_rounds: int = 0  # rounds with no draft (prompt lookup found nothing, or no budget was left to draft)
    drafted: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)
    offered: list[int] = field(default_factory=list)

    def add(self, drafts: int, accepted: int) -> None:
        self.rounds += 1
        self.empty_rounds += drafts == 0
        self.drafted += drafts
        self.accepted += accepted
        if drafts > len(self.offered):
            grow = drafts - len(self.offered)
            self.offered += [0] * grow
            self.per_position += [0] * grow
        for i in range(drafts):
            self.offered[i] += 1
            self.per_position[i] += int(i < accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a round's verification yields: accepted drafts plus the target's own token
        (before a last round is cut at an EOS)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def position_rates(self) -> list[float]:
        """Per draft position, the fraction of rounds offering it that accepted it."""
        return [a / o for a, o in zip(self.per_position, self.offered)]


_NOT_HF_PATH = ("RecoverSSMCache serves models converted with ssm_spec.hf.apply_recoverssm; transformers' own "
                "GatedDeltaNet forward must not write into it")


class RecoverLinearAttentionLayer(LinearAttentionLayer):
    """The cache entry of a converted GDN layer. It holds no tensors (the cache's
    :class:`RollbackPool` does) and reports what transformers asks of a linear layer:
    croppable, never compiled, crop/reorder/reset handled once by the cache."""

    def __init__(self, owner=None):
        super().__init__(number_of_states=1)
        self.record_past = True
        # the cache holding it, the one that knows the tokens held (no cycle back)
        self._owner = None if owner is None else BackRef(owner)

    @property
    def owner(self):
        """The cache holding this layer (``None``: none, or it is gone)."""
        return None if self._owner is None else self._owner()

    def get_seq_length(self) -> int:
        """Tokens held per row, as the owning cache counts them (transformers 5.25's own linear
        layers count their updates; these layers see none)."""
        return 0 if self.owner is None else self.owner.get_seq_length()

    def lazy_initialization(self, *args, **kwargs):
        raise RuntimeError(_NOT_HF_PATH)

    def update_conv_state(self, *args, **kwargs):
        raise RuntimeError(_NOT_HF_PATH)

    def update_recurrent_state(self, *args, **kwargs):
        raise RuntimeError(_NOT_HF_PATH)

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove) -> None:  # the cache crops every linear layer at once
        pass

    def reorder_cache(self, beam_idx) -> None:
        pass

    def reset(self) -> None:
        pass


class RecoverSSMCache(DynamicCache):
    """The cache ``generate`` uses on a model converted by :func:`~ssm_spec.hf.apply_recoverssm`.

    Args:
        model: the converted model (its text config sizes the attention layers; its converted
            GDN layers own the states). On a model spread over devices by a device map each
            layer's states live on the device its forward runs on (docs/design.md section 5.9).
        max_pending: tokens per sequence kept croppable between forwards (``>= 1``); the
            converted ``generate`` raises it to the draft length it will use. A prompt forward
            runs the chunked prefill over all but its last ``max_pending`` tokens.
        state_dtype: recurrent state dtype, ``torch.float32`` (default) or ``torch.bfloat16``.
        mode: ``"exact"`` (default) or ``"fast"``: the verify the layers run (docs/design.md
            section 2.6; :class:`~ssm_spec.StatePool`).
        max_cache_len: ``None`` (default): attention layers grow as transformers' own do. An
            int: attention layers are :class:`~ssm_spec.hf.static_kv.StaticAttentionLayer`
            buffers of this many tokens and every forward of the converted model runs through
            :class:`~ssm_spec.hf.graphed.GraphedForward` (``graphed``), which captures verify
            forwards as CUDA graphs on a GPU (``apply_recoverssm(model, cuda_graphs=True)``
            makes such caches).

    Attributes:
        kv_capacity: ``max_cache_len`` (``None`` without static attention buffers).
        graphed: the :class:`~ssm_spec.hf.graphed.GraphedForward` of a cache with
            ``max_cache_len`` (else ``None``).
        stats: :class:`AcceptanceStats` of the speculative rounds seen by ``crop``.
        prompt_len: tokens of the current ``generate`` call's first forward that are prompt:
            the prompt tokens the cache does not hold yet (set by the converted ``generate`` at
            every call, :meth:`begin_generate`; used only to count that round's drafts, so a
            follow-up turn on a reused cache does not count its new prompt as drafts).

    ``crop(m)`` with ``m <= 0`` removes the last ``-m`` tokens of every layer (transformers
    5.15+; a 0-d tensor is accepted); a positive ``m`` is a length to crop to.

    Raises:
        ValueError: from ``crop``, a rollback deeper than the tokens held (nothing changes).
    """

    #: How a converted layer (:class:`~ssm_spec.hf.adapter.RecoverGDNAdapter`) recognises this cache
    #: without importing this module (which imports the adapter's).
    rolls_back_linear_attention = True

    def __init__(self, model, max_pending: int = 1, state_dtype: torch.dtype = torch.float32,
                 max_cache_len: int | None = None, mode: str = "exact"):
        from .graphed import GraphedForward

        check_mode("RecoverSSMCache", mode)
        check_state_dtype("RecoverSSMCache", state_dtype)
        if int(max_pending) < 1:
            raise ValueError(f"RecoverSSMCache: max_pending: got {max_pending}; expected >= 1")
        config = model.config.get_text_config(decoder=True)
        super().__init__(config=config)
        self.adapters = [m for m in model.modules() if isinstance(m, RecoverGDNAdapter)]
        if not self.adapters:
            raise ValueError("RecoverSSMCache: the model has no converted GDN layer; call apply_recoverssm(model)")
        if max_cache_len is not None and int(max_cache_len) < 1:
            raise ValueError(f"RecoverSSMCache: max_cache_len: got {max_cache_len}; expected >= 1 or None")
        linear = {a.layer_idx for a in self.adapters}
        for i in linear:
            if i >= len(self.layers):
                raise ValueError(f"RecoverSSMCache: converted layer index {i} is outside the config's "
                                 f"{len(self.layers)} layers")
            self.layers[i] = RecoverLinearAttentionLayer(self)
        self.kv_capacity = None if max_cache_len is None else int(max_cache_len)
        if self.kv_capacity is not None:
            for i in range(len(self.layers)):
                if i not in linear:
                    self.layers[i] = StaticAttentionLayer(self.kv_capacity)
        self.graphed = GraphedForward(self) if self.kv_capacity is not None else None
        self.max_pending = int(max_pending)
        self.state_dtype = state_dtype
        self.mode = mode
        self.rollback: RollbackPool | None = None
        self.stats = AcceptanceStats()
        self.prompt_len: int | None = None
        self._open: tuple[int, int] | None = None  # (rows, tokens) of the forward in progress
        self._planned = False  # whether the open forward's rollback plan is made
        self._forwards = 0  # forwards since the current generate call began (or since creation)
        self._last_forward_len = 0
        self._since_crop = 0

    def begin_generate(self, prompt_tokens: int | None) -> None:
        """A ``generate`` call begins: its first forward holds ``prompt_tokens`` prompt tokens the
        cache does not hold yet (``None`` or negative: unknown, and that round's drafts are not
        counted) before its drafts. Called by the converted model's ``generate`` before
        transformers' own runs anything.

        Raises:
            ValueError: an empty prompt (no tokens, and an empty cache), as ssm-spec's decode
                loop refuses one; nothing is changed.
        """
        if prompt_tokens == 0 and self.get_seq_length() == 0:
            raise ValueError("generate: the prompt (input_ids) has no tokens; give at least one (a BOS token, say)")
        self.prompt_len = None if prompt_tokens is None or prompt_tokens < 0 else int(prompt_tokens)
        self._forwards = 0

    # ------------------------------------------------------------------ forwards
    @property
    def forward_open(self) -> bool:
        """Whether a forward of the model is in progress on this cache (:meth:`begin_forward`)."""
        return self._open is not None

    def begin_forward(self, batch_size: int, num_tokens: int, dtype: torch.dtype | None = None,
                      device=None) -> None:
        """A forward of ``num_tokens`` tokens for each of ``batch_size`` rows begins: called by the
        forward that owns the cache (the converted model's decoder, or its graphed path) before
        any layer runs, and closed by :meth:`end_forward`. With ``dtype`` and ``device`` (the
        hidden states') the rollback plan is made now; otherwise at the first converted layer,
        from its hidden states (a model spread over devices learns there where they are).

        Raises:
            ValueError: a forward is already open on this cache; a batch size other than the
                sequence's (mid-sequence).
        """
        if self._open is not None:
            raise ValueError("RecoverSSMCache.begin_forward: a forward is already open on this cache")
        self._open, self._planned = (int(batch_size), int(num_tokens)), False
        if dtype is not None and device is not None:
            try:
                self._plan_forward(dtype, device)
            except ValueError:
                self._open = None
                raise

    def end_forward(self) -> None:
        """The forward begun by :meth:`begin_forward` has ended (a no-op when none is open)."""
        self._open, self._planned = None, False

    def linear_forward(self, adapter, hidden: torch.Tensor) -> torch.Tensor:
        """Run a converted layer over ``hidden [B, L, D]`` within the open forward.

        Raises:
            ValueError: no forward is open (a converted layer called outside its model's
                forward); hidden states of another shape than the forward announced.
        """
        if self._open is None:
            raise ValueError("RecoverSSMCache: a converted layer ran outside a forward of its model; call the "
                             "converted model (or its decoder, model.model), which opens the forward on the cache, "
                             "or bracket the call with cache.begin_forward(batch, tokens) / cache.end_forward()")
        if tuple(hidden.shape[:2]) != self._open:
            raise ValueError(f"RecoverSSMCache: a converted layer got hidden states {tuple(hidden.shape[:2])} in a "
                             f"forward of {self._open} (rows, tokens)")
        if not self._planned:
            self._plan_forward(hidden.dtype, hidden.device)
        return self.rollback.run(adapter, hidden)

    def _plan_forward(self, dtype, device) -> None:
        B, L = self._open
        self._begin_forward(B, L, dtype, device)
        self._planned = True

    def _begin_forward(self, B, L, dtype, device):
        """Plan a forward of ``L`` tokens for each of ``B`` rows on the rollback pool (made here
        on the first forward, with ``dtype`` conv states, each layer's states on the device its
        forward runs on: its accelerate hook's execution device or its weights' device, else
        ``device``, the hidden states': :func:`~ssm_spec.hf.placement.layer_devices`)."""
        rb = self.rollback
        if rb is None or rb.batch_size != B:
            if rb is not None and rb.seen:
                raise ValueError(f"RecoverSSMCache: batch size changed from {rb.batch_size} to {B} mid-sequence")
            self.rollback = rb = RollbackPool(self.adapters, B, self.max_pending, dtype=self.state_dtype,
                                              conv_dtype=dtype, device=layer_devices(self.adapters, device),
                                              mode=self.mode)
        rb.max_pending = max(rb.max_pending, self.max_pending)
        rb.begin_forward(L)
        self._forwards += 1
        self._last_forward_len = L
        self._since_crop += 1

    # ------------------------------------------------------------------ transformers' cache API
    def crop(self, max_length) -> None:
        m = int(max_length)
        if m != max_length:
            raise ValueError(f"crop: expected an integer number of tokens, got {max_length!r}")
        if m > 0:  # an absolute length (older callers)
            remove = self.get_seq_length() - m
            if remove < 0:
                return
        else:
            remove = -m
        rb = self.rollback
        if rb is not None:
            one_round = self._since_crop == 1
            first = self._forwards == 1
            rb.crop(remove)  # raises before anything changes
            if one_round:
                drafts = self._last_forward_len - (self.prompt_len or 0) if first else self._last_forward_len - 1
                if drafts >= 0 and not (first and self.prompt_len is None):
                    self.stats.add(drafts, max(0, drafts - remove))
        elif remove:
            raise ValueError(f"crop: cannot remove {remove} tokens from an empty cache")
        self._since_crop = 0
        for layer in self.layers:
            if not isinstance(layer, RecoverLinearAttentionLayer):
                layer.crop(-remove)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held per row (a host int). A converted layer's index answers for the first
        attention layer, as transformers up to 5.24 did for every linear layer (5.25 asks the
        layer, which holds nothing here); with no attention layer, the rollback pool's count."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], RecoverLinearAttentionLayer):
            layer_idx = next((i for i, layer in enumerate(self.layers)
                              if not isinstance(layer, RecoverLinearAttentionLayer)), None)
            if layer_idx is None:
                return self.rollback.seen if self.rollback is not None else 0
        return super().get_seq_length(layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        if self.rollback is not None:
            self.rollback.reorder(beam_idx)
        super().reorder_cache(beam_idx)

    def reset(self, keep_stats: bool = False):
        """Forget every token. A cache with ``max_cache_len`` keeps its buffers (and so its
        captured graphs) for the next sequence of the same batch size; ``keep_stats`` keeps the
        acceptance counts (a follow-up assisted turn, which re-reads its whole prompt)."""
        if self.graphed is not None and self.rollback is not None:
            self.rollback.reset()
        else:
            self.rollback = None
        if not keep_stats:
            self.stats = AcceptanceStats()
        self.prompt_len = None
        self._open, self._planned = None, False
        self._forwards = self._since_crop = 0
        super().reset()
        for layer in self.layers:  # attention layers: drop the tokens, not only zero them
            if not isinstance(layer, (RecoverLinearAttentionLayer, StaticAttentionLayer)) \
                    and getattr(layer, "is_initialized", False):
                # transformers 5.17's DynamicLayer.reset zeroes its keys and values but keeps their
                # length (5.18 drops them), so the next forward would attend to zeroed tokens
                layer.keys = layer.values = None
                layer.is_initialized = False
