"""``RecoverShortConv``: the (dilated) causal depthwise short conv as a RecoverSSM layer."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..metadata import RecoverSSMMetadata, group_prefill_rows
from ..ops import _eager
from ..pools import ConvStateSpec, StatePool
from .prefill import conv_prefill_row, conv_prefill_rows
from .tensor_parallel import all_gather_channels, shard_short_conv_, tp_share

__all__ = ["RecoverShortConv", "run_short_conv"]


def check_inference(name: str, x: torch.Tensor, module) -> None:
    """The layers are inference kernels: refuse grad mode with tensors that require grad,
    rather than return outputs silently cut off from the parameters' gradients."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        raise ValueError(f"{name}: called with grad mode on and tensors that require grad; expected "
                         "inference (torch.no_grad() or torch.inference_mode()): the kernels have no "
                         "autograd formula")


def _prefill_batched(rows, x, weight, bias, conv_state, out, dilation, activation):
    """The prefill rows without boundaries in groups of one length, each group one batched
    conv (:func:`conv_prefill_rows`); returns the rows left for the per-row path."""
    groups, rest = group_prefill_rows(rows)
    for group in groups.values():
        idx = torch.stack([torch.arange(r.bos, r.eos, device=x.device) for r in group])
        init = torch.stack([conv_state[r.src] if r.src >= 0 else conv_state.new_zeros(conv_state.shape[1:])
                            for r in group])
        y, final = conv_prefill_rows(x[idx], weight, bias, init, dilation, activation)
        out[idx.reshape(-1)] = y.reshape(-1, y.shape[-1])
        conv_state[torch.tensor([r.dst for r in group], device=conv_state.device)] = final.to(conv_state.dtype)
    return rest


def run_short_conv(x, weight, bias, conv_state, rec_x, metadata: RecoverSSMMetadata, dilation, activation,
                   pool: StatePool | None = None):
    """The conv of one layer over a mixed step: verify rows through ``short_conv_verify``
    (state read only, inputs recorded in ``rec_x``; in the pool's snapshot mode the state after
    every token is also written to its scratch slot), prefill rows through
    :func:`conv_prefill_row` (final and boundary states written). Returns ``[T, C]``."""
    T = x.shape[0]  # may exceed metadata.num_tokens: rows outside every window stay zero
    out = torch.zeros_like(x)
    span = metadata.verify_span
    V = span.stop - span.start  # the verify windows' span: the records need only these rows
    if T < metadata.num_tokens or V > rec_x.shape[0]:
        raise ValueError(f"the step has {T} token rows and its verify windows span {V}; expected at "
                         f"least the metadata's {metadata.num_tokens} rows and a span within the pool's "
                         f"max_tokens {rec_x.shape[0]}")
    metadata.check_pool(conv_state.shape[0] if pool is None else pool.num_slots)
    if pool is not None and pool.snapshot and metadata.align:
        raise ValueError("snapshot mode (StatePool(snapshot=True)) supports no align mode")
    if metadata.has_verify:
        if metadata.fresh_slots.numel():
            conv_state.index_fill_(0, metadata.fresh_slots.long(), 0)
        _eager.call("short_conv_verify", x[span], weight, bias, conv_state, metadata.verify_indices,
                    metadata.verify_query_start_loc, out[span], rec_x[:V], dilation, activation)
        if pool is not None:
            pool.protocol.conv_verified(pool, conv_state, rec_x[:V], metadata)
    rows = metadata.prefill_rows
    if len(rows) > 1:
        rows = _prefill_batched(rows, x, weight, bias, conv_state, out, dilation, activation)
    for row in rows:
        init = conv_state[row.src] if row.src >= 0 else conv_state.new_zeros(conv_state.shape[1:])
        y, final, bounds = conv_prefill_row(x[row.bos:row.eos], weight, bias, init, dilation, activation,
                                            [off for off, _ in row.boundaries])
        out[row.bos:row.eos] = y
        for (_, slot), state in zip(row.boundaries, bounds):
            conv_state[slot] = state.detach()  # the pool never joins an autograd graph
        conv_state[row.dst] = final.detach()
    return out


class RecoverShortConv(nn.Module):
    """The PLE dilated short conv: ``y_t = act(bias + sum_j w[:, j] * x_{t-(ks-1-j)*D})``.

    Parameters follow ``nn.Conv1d`` (depthwise): ``weight [C, 1, kernel_size]``, ``bias [C]``.
    Its state is the last ``(kernel_size - 1) * dilation`` inputs, held in a
    :class:`~ssm_spec.StatePool`; verify rows read it and record their inputs, the commit
    compacts it (docs/design.md sections 1.4, 2.2).

    Args:
        channels: ``C``. kernel_size: taps (>= 1). dilation: ``D`` (>= 1).
        activation: ``"silu"`` or ``"none"``. bias: learn a bias.
        tp_group: a ``torch.distributed`` process group: tensor parallelism; the layer keeps
            channels ``[r C/P, (r+1) C/P)`` (``C`` is the full count), its pool holds only those,
            and the output is all-gathered (``[T, C]`` on every rank). ``None``: all local.

    Raises:
        ValueError: on a bad size, dilation or activation; ``C`` not divisible by the
            tensor-parallel size.
    """

    tp_group = None

    def __init__(self, channels: int, kernel_size: int, dilation: int = 1, activation: str = "silu",
                 bias: bool = False, device=None, dtype=None, tp_group=None):
        super().__init__()
        if tp_group is not None:
            self.tp_channels = tp_share(channels, tp_group, "channels", "RecoverShortConv")
            channels = self.tp_channels[1] - self.tp_channels[0]
            self.tp_group = tp_group
        if channels < 1 or kernel_size < 1 or dilation < 1:
            raise ValueError(f"RecoverShortConv: channels={channels}, kernel_size={kernel_size}, "
                             f"dilation={dilation}; expected all >= 1")
        if activation not in ("silu", "none"):
            raise ValueError(f"RecoverShortConv: activation: got {activation!r}; expected 'silu' or 'none'")
        self.channels, self.kernel_size, self.dilation, self.activation = channels, kernel_size, dilation, activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(channels, device=device, dtype=dtype)) if bias else None
        bound = 1 / math.sqrt(kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def state_specs(self):
        """The state a :class:`~ssm_spec.StatePool` keeps for this layer: the last
        ``(kernel_size - 1) * dilation`` inputs, ``[Lc, C]``."""
        return [("conv", ConvStateSpec((self.kernel_size - 1) * self.dilation, self.channels))]

    def forward(self, x: torch.Tensor, metadata: RecoverSSMMetadata, pool: StatePool) -> torch.Tensor:
        """``x [T, C]`` -> ``[T, C]`` for the step described by ``metadata``.
        Args:
            x: ``[T, C]`` float32/bfloat16/float16 (``T`` may exceed the metadata's token
                count; rows outside every window come out zero).
            metadata: the step's :class:`~ssm_spec.RecoverSSMMetadata`, built on
                ``pool.device``; pass the same object to every layer of the step (a layer on
                another of the pool's devices copies it itself, once per device).
            pool: the :class:`~ssm_spec.StatePool` holding this layer's states (``x`` and the
                parameters on their device; on a pool over several devices the step runs with
                that device current).

        Inference only: call it under ``torch.no_grad()`` (or ``torch.inference_mode()``).

        Raises:
            ValueError: with grad mode on and a tensor that requires grad (the kernels have no
                autograd formula); a slot the pool does not have; verify windows spanning more
                tokens than the pool's ``max_tokens``; snapshot mode with align mode; a layer the
                pool does not hold. Raised before anything is written.
        """
        check_inference("RecoverShortConv", x, self)
        if self.tp_group is not None:  # this rank's channels of the full input
            x = x[:, self.tp_channels[0]:self.tp_channels[1]]
        conv_state = pool.conv_state(self)
        with pool.launch_guard(conv_state.device):  # a no-op context on a pool on one device
            out = run_short_conv(x, self.weight[:, 0], self.bias, conv_state, pool.conv_record(self, pool.max_tokens),
                                 metadata.to(conv_state.device), self.dilation, self.activation, pool)
        if self.tp_group is not None:
            out = all_gather_channels(out, self.tp_group)
        return out

    def shard_(self, tp_group) -> RecoverShortConv:
        """Keep only this rank's channels of a full layer, in place; returns ``self``.

        Raises:
            ValueError: ``C`` not divisible by the group's size, or already sharded.
        """
        if self.tp_group is not None:
            raise ValueError("RecoverShortConv.shard_: the layer is already sharded")
        shard_short_conv_(self, tp_group)
        return self
