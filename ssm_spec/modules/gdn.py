"""``RecoverGatedDeltaNet``: the Qwen3-Next / Qwen3.5 GDN layer on RecoverSSM ops.

Parameter names and shapes are Hugging Face's (docs/design.md section 5.1): Qwen3-Next
(``in_proj_qkvz``, ``in_proj_ba``, grouped per key head) and Qwen3.5 (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``), plus ``conv1d``, ``dt_bias``, ``A_log``,
``norm`` and ``out_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..metadata import RecoverSSMMetadata, group_prefill_rows
from ..pools import ConvStateSpec, GDNStateSpec, StatePool
from .prefill import conv_prefill_rows, gdn_prefill_row, gdn_prefill_rows, gdn_prefill_rows_batched, uses_fla
from .short_conv import check_inference, run_short_conv
from .tensor_parallel import all_reduce_, shard_gdn_, tp_share

__all__ = ["RecoverGatedDeltaNet", "GatedRMSNorm"]

LAYOUTS = ("qwen3_next", "qwen3_5")


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)``, computed as Hugging Face's
    ``Qwen3NextRMSNormGated`` does (normalise in fp32, scale in the input dtype, gate in fp32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


class RecoverGatedDeltaNet(nn.Module):
    """A GDN layer whose decode steps are RecoverSSM verifies (commit with :func:`ssm_spec.commit`).

    Forward takes flat hidden states ``[T, hidden]`` of a step (any mix and order of prefill
    and verify rows, docs/design.md section 5.1), its :class:`~ssm_spec.RecoverSSMMetadata` and the
    :class:`~ssm_spec.StatePool`; verify rows read their checkpoint and write replay records,
    prefill rows run the chunked prefill and write their final (and boundary) states.

    Args:
        hidden_size, num_k_heads (``H``), num_v_heads (``HV``), head_k_dim (``K``),
        head_v_dim (``V``), conv_kernel_size, rms_norm_eps: Hugging Face's config values
            (``linear_num_key_heads``, ...).
        layout: ``"qwen3_next"`` or ``"qwen3_5"`` (the projection layout).
        tp_group: a ``torch.distributed`` process group: tensor parallelism (module
            :mod:`ssm_spec.modules.tensor_parallel`); the layer keeps this rank's share of the
            heads (``H`` and ``HV`` are the full model's), its pool holds only those, and the
            output is all-reduced over the group. ``None``: every head is local.

    Raises:
        ValueError: on an unknown layout, ``HV % H != 0``, or ``H`` / ``HV`` not divisible by
            the tensor-parallel size.
    """

    tp_group = None

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int = 4, rms_norm_eps: float = 1e-6,
                 layout: str = "qwen3_next", device=None, dtype=None, tp_group=None):
        super().__init__()
        if tp_group is not None:
            h0, h1 = tp_share(num_k_heads, tp_group, "num_k_heads", "RecoverGatedDeltaNet")
            v0, v1 = tp_share(num_v_heads, tp_group, "num_v_heads", "RecoverGatedDeltaNet")
            num_k_heads, num_v_heads = h1 - h0, v1 - v0
            self.tp_group = tp_group
        if layout not in LAYOUTS:
            raise ValueError(f"RecoverGatedDeltaNet: layout: got {layout!r}; expected one of {LAYOUTS}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"RecoverGatedDeltaNet: num_v_heads={num_v_heads} is not a multiple of "
                             f"num_k_heads={num_k_heads}")
        self.hidden_size, self.layout = hidden_size, layout
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = head_k_dim * num_k_heads, head_v_dim * num_v_heads
        self.conv_kernel_size = conv_kernel_size
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kw = dict(device=device, dtype=dtype)
        if layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **kw)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **kw)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False, **kw)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False, **kw)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False, **kw)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False, **kw)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,
                                padding=conv_kernel_size - 1, bias=False, **kw)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads, **kw).uniform_(1, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps=rms_norm_eps, **kw)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf(cls, module: nn.Module, tp_group=None) -> RecoverGatedDeltaNet:
        """Wrap a Hugging Face ``Qwen3NextGatedDeltaNet`` or ``Qwen3_5GatedDeltaNet``, sharing
        its parameters (the HF submodules themselves are reused, so state-dict keys match).
        With ``tp_group``, the layer keeps copies of this rank's slices of the full layer's
        weights instead (:meth:`shard_`).

        Raises:
            ValueError: if ``module`` has neither projection layout, or its conv activation is
                not SiLU; heads not divisible by the tensor-parallel size.
        """
        if hasattr(module, "in_proj_qkvz"):
            layout = "qwen3_next"
        elif hasattr(module, "in_proj_qkv"):
            layout = "qwen3_5"
        else:
            raise ValueError(f"RecoverGatedDeltaNet.from_hf: {type(module).__name__} has neither "
                             "in_proj_qkvz (Qwen3-Next) nor in_proj_qkv (Qwen3.5)")
        if getattr(module, "activation", "silu") not in ("silu", "swish"):
            raise ValueError(f"RecoverGatedDeltaNet.from_hf: activation: got {module.activation!r}; "
                             "expected 'silu' (the conv activation these layers use)")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.hidden_size, self.layout = module.hidden_size, layout
        self.num_k_heads, self.num_v_heads = module.num_k_heads, module.num_v_heads
        self.head_k_dim, self.head_v_dim = module.head_k_dim, module.head_v_dim
        self.key_dim, self.value_dim = module.key_dim, module.value_dim
        self.conv_kernel_size = module.conv_kernel_size
        self.conv_dim = module.conv_dim
        names = ("in_proj_qkvz", "in_proj_ba") if layout == "qwen3_next" else (
            "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        for name in (*names, "conv1d", "norm", "out_proj"):
            setattr(self, name, getattr(module, name))
        self.dt_bias, self.A_log = module.dt_bias, module.A_log
        if tp_group is not None:
            self.shard_(tp_group)
        return self

    def shard_(self, tp_group) -> RecoverGatedDeltaNet:
        """Keep only this rank's heads of a full layer, in place (tensor parallelism,
        :func:`ssm_spec.modules.tensor_parallel.shard_gdn_`); returns ``self``.

        Raises:
            ValueError: ``H`` or ``HV`` not divisible by the group's size, or already sharded.
        """
        if self.tp_group is not None:
            raise ValueError("RecoverGatedDeltaNet.shard_: the layer is already sharded")
        shard_gdn_(self, tp_group)
        return self

    # ------------------------------------------------------------------ forward
    def state_specs(self):
        """The states a :class:`~ssm_spec.StatePool` keeps for this layer: its recurrent state
        ``[HV, K, V]`` and its qkv conv state ``[kernel_size - 1, 2*H*K + HV*V]``."""
        return [("gdn", GDNStateSpec(self.num_v_heads, self.num_k_heads, self.head_k_dim, self.head_v_dim)),
                ("conv", ConvStateSpec(self.conv_kernel_size - 1, self.conv_dim))]

    def project(self, hidden: torch.Tensor):
        """``[T, hidden]`` -> ``(mixed_qkv [T, 2*H*K + HV*V], z [T, HV, V], b [T, HV], a [T, HV])``;
        every tensor keeps its own token's values (no reordering across tokens)."""
        T = hidden.shape[0]
        H, HV, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.layout == "qwen3_next":
            g = HV // H
            qkvz = self.in_proj_qkvz(hidden).view(T, H, 2 * K + 2 * g * V)
            q, k, v, z = torch.split(qkvz, [K, K, g * V, g * V], dim=-1)
            ba = self.in_proj_ba(hidden).view(T, H, 2 * g)
            b, a = torch.split(ba, [g, g], dim=-1)
            mixed = torch.cat([q.reshape(T, H * K), k.reshape(T, H * K), v.reshape(T, HV * V)], dim=-1)
            return mixed, z.reshape(T, HV, V), b.reshape(T, HV), a.reshape(T, HV)
        z = self.in_proj_z(hidden).view(T, HV, V)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)

    def gates(self, conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        """The GDN inputs from the conv output and the gate projections (docs/design.md section 2.2; the
        gating of transformers' Qwen3-Next / Qwen3.5 layers): ``q, k [T, H, K]`` and
        ``v [T, HV, V]`` as views of ``conv_out [T, 2*H*K + HV*V]``, the fp32 log decay
        ``g = -exp(A_log) * softplus(a + dt_bias)`` ``[T, HV]`` and ``beta = sigmoid(b)`` ``[T, HV]``."""
        H, HV, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        q = conv_out[:, : self.key_dim].unflatten(1, (H, K))
        k = conv_out[:, self.key_dim : 2 * self.key_dim].unflatten(1, (H, K))
        v = conv_out[:, 2 * self.key_dim :].unflatten(1, (HV, V))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v, g, b.sigmoid()

    def output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``core [T, HV, V]`` gated by ``z [T, HV, V]`` through the layer's RMSNorm, then
        ``out_proj``: ``[T, hidden]``."""
        T, HV, V = core.shape
        return self.out_proj(self.norm(core.reshape(T * HV, V), z.reshape(T * HV, V)).reshape(T, self.value_dim))

    @staticmethod
    def _prefill_batched(rows, q, k, v, g, beta, state, core, scale):
        """Prefill the rows without boundaries in groups of equal length (one token loop per
        group, :func:`gdn_prefill_rows_batched`); returns the rows left for the per-row path."""
        groups, rest = group_prefill_rows(rows)
        for group in groups.values():
            idx = torch.stack([torch.arange(r.bos, r.eos, device=q.device) for r in group])  # [R, L]
            init = torch.stack([state[r.src].float() if r.src >= 0 else
                                state.new_zeros(state.shape[1:], dtype=torch.float32) for r in group])
            out, final = gdn_prefill_rows_batched(q[idx], k[idx], v[idx], g[idx], beta[idx], init, scale)
            core[idx.reshape(-1)] = out.reshape(-1, *out.shape[2:]).to(core.dtype)
            state[torch.tensor([r.dst for r in group], device=state.device)] = final.to(state.dtype)
        return rest

    def forward(self, hidden: torch.Tensor, metadata: RecoverSSMMetadata, pool: StatePool) -> torch.Tensor:
        """``hidden [T, hidden]`` -> ``[T, hidden]`` for the step described by ``metadata``.
        Args:
            hidden: ``[T, hidden]`` float32/bfloat16/float16 (``T`` may exceed the metadata's token
                count; rows outside every window come out zero).
            metadata: the step's :class:`~ssm_spec.RecoverSSMMetadata`, built on
                ``pool.device``; pass the same object to every layer of the step (a layer on
                another of the pool's devices copies it itself, once per device:
                :meth:`~ssm_spec.RecoverSSMMetadata.to`). A folded pool recognises the step by
                this object: a second metadata object within one step (a copy made by the
                caller, say) is refused.
            pool: the :class:`~ssm_spec.StatePool` holding this layer's states; ``hidden`` and
                the layer's parameters are on the device of those states
                (``pool.device_of(layer)``). On a pool over several devices the step runs
                with that device current (``torch.cuda.device``; the kernels launch on the
                current CUDA device).

        Inference only: call it under ``torch.no_grad()`` (or ``torch.inference_mode()``).

        Raises:
            ValueError: with grad mode on and a tensor that requires grad (the kernels have no
                autograd formula); a slot the pool does not have; verify windows spanning more
                tokens than the pool's ``max_tokens``; snapshot or folded mode with align mode; a
                prefill row continuing from a slot with a pending window (exact folded mode, see
                :meth:`StatePool.fold_plan`); a verify window past a fast folded pool's
                ``max_window``; a layer the pool does not hold; a folded pool given another
                metadata object than the step's earlier layers got. Raised before anything is
                written.
        """
        check_inference("RecoverGatedDeltaNet", hidden, self)
        state = pool.gdn_state(self)
        dev = state.device  # a pool spread over devices: this layer's states, plans and metadata live here
        with pool.launch_guard(dev):  # a no-op context on a pool on one device
            return self._step(hidden, metadata, pool, state, dev)

    def prefill_padded(self, hidden: torch.Tensor, valid: torch.Tensor, pool: StatePool,
                       slots: torch.Tensor) -> torch.Tensor:
        """Prefill ``B`` left-padded rows of ``L`` columns from the zero state with fixed shapes
        and no host reads, so a CUDA graph holds it (the decode loop's prefill, docs/design.md
        section 7.7); :meth:`forward`'s prefill rows need a host plan per row instead.

        Args:
            hidden: ``[B, L, hidden]`` float32/bfloat16/float16.
            valid: ``[B, L]`` bool, the row's real tokens; ``False`` columns come before them
                (left padding; a row without real tokens ends with zero states). A padding column
                changes no state: its conv input is zeroed (the row's first real tokens see the
                zero conv history of a fresh row) and its ``beta`` and log decay are 0 (the
                recurrent state passes it unchanged).
            pool: the :class:`~ssm_spec.StatePool` holding this layer's states, on one device.
            slots: ``[B]`` int32/int64, where each row's final recurrent and conv states go.

        Returns:
            ``[B, L, hidden]`` in ``hidden``'s dtype: each real column's output, zeros at padding
            columns. Each row gets what :meth:`forward` gives a prefill row of its real tokens,
            up to rounding (the projections' GEMMs and fla's chunks see other shapes).

        Raises:
            ValueError: ``valid`` or ``slots`` of another shape than ``hidden``'s rows and columns;
                grad mode with tensors that require grad. Raised before anything is written.
        """
        check_inference("RecoverGatedDeltaNet", hidden, self)
        B, L, D = hidden.shape
        if tuple(valid.shape) != (B, L) or valid.dtype != torch.bool:
            raise ValueError(f"RecoverGatedDeltaNet.prefill_padded: valid has shape {tuple(valid.shape)} and dtype "
                             f"{valid.dtype}; expected ({B}, {L}) bool, as hidden's rows and columns")
        if tuple(slots.shape) != (B,):
            raise ValueError(f"RecoverGatedDeltaNet.prefill_padded: slots has shape {tuple(slots.shape)}; "
                             f"expected ({B},), one slot per row of hidden")
        HV, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
        padding = ~valid.reshape(B * L, 1)
        mixed, z, b, a = self.project(hidden.reshape(B * L, D))
        mixed = mixed.masked_fill(padding, 0)
        conv_state = pool.conv_state(self)
        history = conv_state.new_zeros((B, *conv_state.shape[1:]))
        conv_out, conv_final = conv_prefill_rows(mixed.view(B, L, -1), self.conv1d.weight[:, 0], self.conv1d.bias,
                                                 history, 1, "silu")
        q, k, v, g, beta = self.gates(conv_out.reshape(B * L, -1), a, b)
        g = g.masked_fill(padding, 0)
        beta = beta.masked_fill(padding, 0)
        state = pool.gdn_state(self)
        init = state.new_zeros((B, *state.shape[1:]), dtype=torch.float32)
        core, final = gdn_prefill_rows(q.view(B, L, *q.shape[1:]), k.view(B, L, *k.shape[1:]),
                                       v.view(B, L, HV, V), g.view(B, L, HV), beta.view(B, L, HV), init, K**-0.5)
        index = slots.long()
        state[index] = final.to(state.dtype)
        conv_state[index] = conv_final.to(conv_state.dtype)
        core = core.reshape(B * L, HV, V).masked_fill(padding[:, :, None], 0).to(v.dtype)
        out = self.output(core, z)
        if self.tp_group is not None:  # row-parallel out_proj: the ranks' partial sums
            all_reduce_(out, self.tp_group)
        return out.masked_fill(padding, 0).view(B, L, D)

    def _step(self, hidden, metadata, pool, state, dev):
        protocol = pool.protocol
        plan = protocol.plan(pool, metadata, dev, self)  # before anything is written: it may refuse the step
        metadata = metadata.to(dev)  # itself on a pool on one device
        T = hidden.shape[0]
        HV, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed, z, b, a = self.project(hidden)
        conv_out = run_short_conv(mixed, self.conv1d.weight[:, 0], self.conv1d.bias, pool.conv_state(self),
                                  pool.conv_record(self, pool.max_tokens), metadata, 1, "silu", pool)
        q, k, v, g, beta = self.gates(conv_out, a, b)
        core = torch.zeros((T, HV, V), dtype=v.dtype, device=v.device)
        scale = K**-0.5
        if metadata.has_verify:
            if metadata.fresh_slots.numel():
                state.index_fill_(0, metadata.fresh_slots.long(), 0)
            span = metadata.verify_span  # the ops run on the tokens the verify windows span
            args = (q[span], k[span], v[span], g[span], beta[span], state, metadata.verify_indices,
                    metadata.verify_query_start_loc)
            protocol.verify(pool, self, args, core[span], metadata, plan, scale)
        rows = metadata.prefill_rows
        if len(rows) > 1 and not uses_fla(q, v):  # the reference's token loop: rows of one length at once
            rows = self._prefill_batched(rows, q, k, v, g, beta, state, core, scale)
        for row in rows:
            init = state[row.src].float() if row.src >= 0 else state.new_zeros(state.shape[1:], dtype=torch.float32)
            sl = slice(row.bos, row.eos)
            out, final, bounds = gdn_prefill_row(q[sl], k[sl], v[sl], g[sl], beta[sl], init,
                                                 [off for off, _ in row.boundaries], scale)
            core[sl] = out
            for (_, slot), s in zip(row.boundaries, bounds):
                state[slot] = s.detach()  # the pool never joins an autograd graph
            state[row.dst] = final.detach()
        out = self.output(core, z)
        if self.tp_group is not None:  # row-parallel out_proj: the ranks' partial sums
            all_reduce_(out, self.tp_group)
        return out
