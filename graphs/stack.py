"""A Qwen3-Next-shaped decoder stack that the captured step, its tests, the example and the
step benchmark run (harness, not library: attention and MLPs are docs/design.md section 8's
"not in this library").

Layers repeat (GDN, GDN, GDN, attention) as in the released Qwen3-Next models; every layer
is pre-norm with a dense SwiGLU MLP. The GDN layers are :class:`ssm_spec.RecoverGatedDeltaNet`;
the attention layers are causal grouped-query attention (SDPA, no rotary embedding) over a
static per-slot KV buffer, so a step allocates nothing that depends on data and can be
captured. The forward takes the step's flat tokens, its :class:`~ssm_spec.RecoverSSMMetadata`
and the :class:`~ssm_spec.StatePool`, like the modules it embeds.

With a process group (``DecoderStack(..., tp_group=g)``) the stack is tensor-parallel: the GDN
layers keep their heads' share (``RecoverGatedDeltaNet.shard_``), the attention layers their
query and KV heads, the MLPs their share of the intermediate width; each of the three ends in one
``all_reduce``. Embedding, norms and LM head are replicated (docs/design.md section 5.9).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import RecoverGatedDeltaNet, RecoverSSMMetadata, StatePool
from ..modules.tensor_parallel import all_reduce_, tp_share

__all__ = ["DecoderStack", "StaticKVAttention", "RowLayout", "REALISTIC_WIDTHS", "TINY_WIDTHS"]

#: Realistic Qwen3-Next-like widths (the step benchmark's and the capture example's default).
REALISTIC_WIDTHS = dict(vocab_size=32768, hidden_size=2048, num_layers=8, intermediate_size=5632, num_k_heads=16,
                        num_v_heads=32, head_k_dim=128, head_v_dim=128, num_heads=16, num_kv_heads=2, head_dim=128)
#: Tiny widths for smoke runs on a CPU.
TINY_WIDTHS = dict(vocab_size=64, hidden_size=32, num_layers=4, intermediate_size=64, num_k_heads=2, num_v_heads=4,
                   head_k_dim=16, head_v_dim=16, num_heads=4, num_kv_heads=2, head_dim=8)


class RowLayout:
    """Where each row's tokens sit in the step's flat token dim, for the attention layers.

    Attributes (device tensors, ``Wm`` = the longest row of the step):
        index ``[B, Wm]`` int64: flat position of row ``b``'s ``j``-th token (clamped into range);
        valid ``[B, Wm]`` bool: ``j`` is inside row ``b``'s window;
        position ``[B, Wm]`` int64: the token's position in its request (``num_computed + j``);
        slot ``[B]`` int64: the row's KV slot (``NULL_SLOT`` rows: padding).
    """

    def __init__(self, metadata: RecoverSSMMetadata, num_tokens: int):
        if metadata.state_indices is None:
            raise ValueError("DecoderStack: align mode is not supported by the attention harness "
                             "(it keys its KV buffer by state_indices)")
        qsl = metadata.query_start_loc.long()
        widths = [metadata.max_window] + [r.eos - r.bos for r in metadata.prefill_rows]
        wm = max(max(widths), 1)
        j = torch.arange(wm, device=qsl.device)
        lens = qsl[1:] - qsl[:-1]
        self.valid = j[None, :] < lens[:, None]
        self.index = (qsl[:-1, None] + j[None, :]).clamp_max(max(num_tokens - 1, 0))
        self.position = metadata.num_computed_tokens.long()[:, None] + j[None, :]
        self.slot = metadata.state_indices.long()
        self.num_tokens = num_tokens


class StaticKVAttention(nn.Module):
    """Causal grouped-query attention over a static ``[2, slots + 1, max_len, kv_heads, head_dim]``
    KV buffer (the last slot takes the writes of padding rows and positions past ``max_len``).

    A step writes each real token's key and value at its position in its row's slot, then
    every query attends to positions ``<= its own`` of that slot. Rejected drafts' entries are
    simply overwritten by later steps before anything reads them.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int,
                 num_slots: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim, self.max_len = num_heads, num_kv_heads, head_dim, max_len
        self.num_slots = num_slots
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False, **kw)
        self.register_buffer("kv", torch.zeros(2, num_slots + 1, max_len, num_kv_heads, head_dim, **kw),
                             persistent=False)

    tp_group = None

    def shares(self, tp_group) -> tuple[int, int, int, int]:
        """``(h0, h1, k0, k1)``: the query heads ``[h0, h1)`` and KV heads ``[k0, k1)`` this rank
        keeps under :meth:`shard_`; changes nothing.

        Raises:
            ValueError: as :meth:`shard_`.
        """
        owner = type(self).__name__
        if self.tp_group is not None:
            raise ValueError(f"{owner}.shard_: the layer is already sharded")
        H, Hkv = self.num_heads, self.num_kv_heads
        h0, h1 = tp_share(H, tp_group, "num_heads", owner)
        size = H // (h1 - h0)
        if Hkv % size == 0:
            k0, k1 = tp_share(Hkv, tp_group, "num_kv_heads", owner)
        elif size % Hkv == 0:  # fewer KV heads than ranks: each rank keeps the one its query heads read
            k0 = h0 // (H // Hkv)
            k1 = k0 + 1
        else:
            raise ValueError(f"{owner}: num_kv_heads={Hkv} is neither divisible by nor a divisor of the "
                             f"tensor-parallel size {size}")
        return h0, h1, k0, k1

    def shard_(self, tp_group) -> StaticKVAttention:
        """Keep this rank's query heads and KV heads, in place (tensor parallelism); returns ``self``.

        On rank ``r`` of ``P``: query heads ``[r H/P, (r+1) H/P)`` (rows of ``q_proj``, input
        columns of ``o_proj``: row-parallel, the forward all-reduces its ``[T, hidden]`` output)
        and the KV heads they read (rows of ``k_proj`` / ``v_proj``, the KV buffer's heads):
        ``[r Hkv/P, (r+1) Hkv/P)`` when ``P`` divides ``Hkv``; when ``Hkv`` divides ``P`` (more
        ranks than KV heads, e.g. 2 KV heads over 4 ranks) the one KV head ``r Hkv / P``,
        replicated on ``P / Hkv`` ranks. The KV buffer is made anew (zeros) for the kept heads.

        Raises:
            ValueError: ``num_heads`` not divisible by the group's size, ``num_kv_heads`` neither
                divisible by nor a divisor of it, or the layer already sharded.
        """
        h0, h1, k0, k1 = self.shares(tp_group)
        D = self.head_dim
        with torch.no_grad():
            self.q_proj = _rows(self.q_proj, h0 * D, h1 * D)
            self.k_proj = _rows(self.k_proj, k0 * D, k1 * D)
            self.v_proj = _rows(self.v_proj, k0 * D, k1 * D)
            self.o_proj = _columns(self.o_proj, h0 * D, h1 * D)
        self.kv = self.kv.new_zeros(2, self.num_slots + 1, self.max_len, k1 - k0, D)
        self.num_heads, self.num_kv_heads = h1 - h0, k1 - k0
        self.tp_group = tp_group
        return self

    def forward(self, x: torch.Tensor, rows: RowLayout) -> torch.Tensor:
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.q_proj(x).view(T, H, D), self.k_proj(x).view(T, Hkv, D), self.v_proj(x).view(T, Hkv, D)
        dump = self.num_slots
        slot = torch.where(rows.slot >= 0, rows.slot, torch.full_like(rows.slot, dump))
        write = rows.valid & (rows.slot[:, None] >= 0) & (rows.position < self.max_len)
        wslot = torch.where(write, slot[:, None], torch.full_like(rows.index, dump)).reshape(-1)
        wpos = torch.where(write, rows.position, torch.zeros_like(rows.position)).reshape(-1)
        idx = rows.index.reshape(-1)
        self.kv[0].index_put_((wslot, wpos), k.index_select(0, idx))
        self.kv[1].index_put_((wslot, wpos), v.index_select(0, idx))
        B, Wm = rows.index.shape
        qb = q.index_select(0, idx).view(B, Wm, H, D).transpose(1, 2)
        keys = self.kv[0].index_select(0, slot).transpose(1, 2)  # [B, Hkv, L, D]
        values = self.kv[1].index_select(0, slot).transpose(1, 2)
        mask = torch.arange(self.max_len, device=x.device)[None, None, :] <= rows.position[:, :, None]
        if Hkv != H:
            keys = keys.repeat_interleave(H // Hkv, dim=1)
            values = values.repeat_interleave(H // Hkv, dim=1)
        o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask[:, None])  # [B, H, Wm, D]
        o = o.transpose(1, 2).reshape(B * Wm, H * D)
        out = x.new_zeros(T + 1, H * D)
        out.index_copy_(0, torch.where(rows.valid.reshape(-1), idx, torch.full_like(idx, T)), o)
        y = self.o_proj(out[:T])
        if self.tp_group is not None:  # row-parallel o_proj: the ranks' partial sums
            all_reduce_(y, self.tp_group)
        return y


def _rows(lin: nn.Linear, start: int, stop: int) -> nn.Linear:
    """A new bias-free ``nn.Linear`` holding output rows ``[start, stop)`` of ``lin`` (column-parallel)."""
    new = nn.Linear(lin.in_features, stop - start, bias=False, device=lin.weight.device, dtype=lin.weight.dtype)
    new.weight.copy_(lin.weight[start:stop])
    return new


def _columns(lin: nn.Linear, start: int, stop: int) -> nn.Linear:
    """A new bias-free ``nn.Linear`` holding input columns ``[start, stop)`` of ``lin`` (row-parallel)."""
    new = nn.Linear(stop - start, lin.out_features, bias=False, device=lin.weight.device, dtype=lin.weight.dtype)
    new.weight.copy_(lin.weight[:, start:stop])
    return new


class _MLP(nn.Module):
    tp_group = None

    def __init__(self, hidden, intermediate, **kw):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, **kw)

    def shares(self, tp_group) -> tuple[int, int]:
        """``(i0, i1)``: the intermediate channels this rank keeps under :meth:`shard_`; changes
        nothing. Raises ``ValueError`` as :meth:`shard_`."""
        if self.tp_group is not None:
            raise ValueError("DecoderStack MLP.shard_: the layer is already sharded")
        return tp_share(self.gate_proj.out_features, tp_group, "intermediate_size", "DecoderStack MLP")

    def shard_(self, tp_group) -> _MLP:
        """Keep intermediate channels ``[r I/P, (r+1) I/P)``: rows of ``gate_proj`` / ``up_proj``
        (column-parallel), input columns of ``down_proj`` (row-parallel, one all-reduce).

        Raises:
            ValueError: ``intermediate_size`` not divisible by the group's size, or the layer
                already sharded.
        """
        i0, i1 = self.shares(tp_group)
        with torch.no_grad():
            self.gate_proj = _rows(self.gate_proj, i0, i1)
            self.up_proj = _rows(self.up_proj, i0, i1)
            self.down_proj = _columns(self.down_proj, i0, i1)
        self.tp_group = tp_group
        return self

    def forward(self, x):
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.tp_group is not None:
            all_reduce_(y, self.tp_group)
        return y


class DecoderStack(nn.Module):
    """Embedding, ``num_layers`` pre-norm blocks (GDN x3 then attention, repeating; a SwiGLU MLP
    each), final norm and LM head.

    Args:
        vocab_size, hidden_size, num_layers, intermediate_size: the widths.
        num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size: the GDN layers'
            (Qwen3-Next's ``linear_*`` config values).
        num_heads, num_kv_heads, head_dim: the attention layers'.
        max_len: positions per KV slot (prompt plus generated tokens plus one window). Nothing
            checks it inside a step (that would read positions back): a token at a position
            ``>= max_len`` is written to the sink slot and its attention is wrong, silently.
        num_slots: requests the KV buffers hold (the state pool's ``num_slots``).
        device, dtype: of the parameters and KV buffers.
        tp_group: a ``torch.distributed`` process group: tensor parallelism over its ``P``
            ranks. The full layers are built, then each rank keeps its share (:meth:`shard_`).
            A later :meth:`randomize` draws the shards' own values, so to compare a sharded
            stack with the unsharded one, randomize the full stack with the same seed on every
            rank, then shard it: ``DecoderStack(...).randomize(seed).shard_(group)``. ``None``
            (default): every head is local, nothing changes.

    ``forward(input_ids [T] int64, metadata, pool) -> logits [T, vocab]`` (fp32). Tokens
    outside every window get logits too (from garbage); nothing reads them.

    Raises:
        ValueError: with ``tp_group``, a width not divisible by the group's size (see :meth:`shard_`).
    """

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                 intermediate_size: int = 128, num_k_heads: int = 2, num_v_heads: int = 4,
                 head_k_dim: int = 16, head_v_dim: int = 16, conv_kernel_size: int = 4,
                 num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, max_len: int = 512,
                 num_slots: int = 8, device=None, dtype=None, tp_group=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(vocab_size, hidden_size, **kw)
        self.mixers = nn.ModuleList()
        for i in range(num_layers):
            if (i + 1) % 4:
                self.mixers.append(RecoverGatedDeltaNet(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                                                        conv_kernel_size, **kw))
            else:
                self.mixers.append(StaticKVAttention(hidden_size, num_heads, num_kv_heads, head_dim, max_len,
                                                     num_slots, **kw))
        self.mixer_norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=1e-6, **kw) for _ in range(num_layers))
        self.mlp_norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=1e-6, **kw) for _ in range(num_layers))
        self.mlps = nn.ModuleList(_MLP(hidden_size, intermediate_size, **kw) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6, **kw)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False, **kw)
        self.tp_group = None
        if tp_group is not None:
            self.shard_(tp_group)

    def shard_(self, tp_group) -> DecoderStack:
        """Keep this rank's share of every layer, in place (tensor parallelism); returns ``self``.

        GDN layers: :meth:`ssm_spec.RecoverGatedDeltaNet.shard_` (key / value heads, their
        projection rows and conv channels; ``out_proj`` row-parallel with one all-reduce).
        Attention: :meth:`StaticKVAttention.shard_` (query and KV heads; ``o_proj`` row-parallel,
        one all-reduce). MLPs: gate / up column-parallel, down row-parallel, one all-reduce.
        Embedding, norms and LM head stay whole on every rank, so every rank computes the same
        logits ``[T, vocab]``. Shard before making the :class:`~ssm_spec.StatePool` (it sizes
        its states from the layers' head counts).

        Raises:
            ValueError: a width not divisible by the group's size (``num_k_heads``,
                ``num_v_heads``, ``num_heads``, ``intermediate_size``; ``num_kv_heads`` neither
                divisible by nor a divisor of it), named; or the stack already sharded. Every
                width is checked before any layer changes: a refused stack stays whole.
        """
        if self.tp_group is not None:
            raise ValueError("DecoderStack.shard_: the stack is already sharded")
        for layer in list(self.mixers) + list(self.mlps):
            if isinstance(layer, RecoverGatedDeltaNet):
                owner = type(layer).__name__
                if layer.tp_group is not None:
                    raise ValueError(f"{owner}.shard_: the layer is already sharded")
                tp_share(layer.num_k_heads, tp_group, "num_k_heads", owner)
                tp_share(layer.num_v_heads, tp_group, "num_v_heads", owner)
            else:
                layer.shares(tp_group)
        for layer in list(self.mixers) + list(self.mlps):
            layer.shard_(tp_group)
        self.tp_group = tp_group
        return self

    def recurrent_layers(self) -> list[nn.Module]:
        """The layers a :class:`~ssm_spec.StatePool` must hold."""
        return [m for m in self.mixers if isinstance(m, RecoverGatedDeltaNet)]

    def kv_buffers(self) -> list[torch.Tensor]:
        return [m.kv for m in self.mixers if isinstance(m, StaticKVAttention)]

    @torch.no_grad()
    def randomize(self, seed: int = 0, std: float | None = None, embed_std: float = 1.0) -> DecoderStack:
        """Seeded random weights at a scale where greedy text is decided by the GDN layers
        and the residual stream (linear weights ``N(0, std)``, default ``1 / sqrt(fan_in)``;
        GDN ``A_log ~ U(-2, 0.5)``, ``dt_bias ~ N(0, 0.5)``; norms at 1); KV buffers zeroed."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("A_log"):
                val = torch.empty(p.shape).uniform_(-2, 0.5, generator=gen)
            elif name.endswith("dt_bias"):
                val = torch.randn(p.shape, generator=gen) * 0.5
            elif name.startswith("embed"):
                val = torch.randn(p.shape, generator=gen) * embed_std
            elif p.dim() >= 2:
                fan_in = p.shape[1] * (p.shape[2] if p.dim() > 2 else 1)
                val = torch.randn(p.shape, generator=gen) * (std if std is not None else fan_in ** -0.5)
            else:
                val = torch.ones(p.shape)
            p.copy_(val.to(p.dtype))
        for kv in self.kv_buffers():
            kv.zero_()
        return self

    def forward(self, input_ids: torch.Tensor, metadata: RecoverSSMMetadata, pool: StatePool) -> torch.Tensor:
        T = input_ids.shape[0]
        rows = RowLayout(metadata, T)
        h = self.embed(input_ids)
        for mixer, n1, n2, mlp in zip(self.mixers, self.mixer_norms, self.mlp_norms, self.mlps):
            x = n1(h)
            h = h + (mixer(x, metadata, pool) if isinstance(mixer, RecoverGatedDeltaNet) else mixer(x, rows))
            h = h + mlp(n2(h))
        return self.lm_head(self.norm(h)).float()
