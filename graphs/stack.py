"""A Qwen3-Next-shaped decoder stack that the captured step, its tests, the example and the
step benchmark run (harness, not library: attention and MLPs are docs/design.md section 8's
"not in this library").

Layers repeat (GDN, GDN, GDN, attention) as in the released Qwen3-Next models; every layer
is pre-norm with a dense SwiGLU MLP. The GDN layers are :class:`ssm_spec.RecoverGatedDeltaNet`;
the attention layers are causal grouped-query attention (SDPA, no rotary embedding) over a
static per-slot KV buffer, so a step allocates nothing that depends on data and can be
captured. The forward takes the step's flat tokens, its :class:`~ssm_spec.RecoverSSMMetadata`
and the :class:`~ssm_spec.StatePool`, like the modules it embeds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import RecoverGatedDeltaNet, RecoverSSMMetadata, StatePool

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
        return self.o_proj(out[:T])


class _MLP(nn.Module):
    def __init__(self, hidden, intermediate, **kw):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    ``forward(input_ids [T] int64, metadata, pool) -> logits [T, vocab]`` (fp32). Tokens
    outside every window get logits too (from garbage); nothing reads them.
    """

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                 intermediate_size: int = 128, num_k_heads: int = 2, num_v_heads: int = 4,
                 head_k_dim: int = 16, head_v_dim: int = 16, conv_kernel_size: int = 4,
                 num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, max_len: int = 512,
                 num_slots: int = 8, device=None, dtype=None):
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
