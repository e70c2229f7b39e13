"""Tensor parallelism for the modules: each rank keeps a contiguous share of the heads
(docs/design.md section 5.9).

A :class:`~ssm_spec.RecoverGatedDeltaNet` over a process group of ``P`` ranks keeps, on rank
``r``, key heads ``[r H/P, (r+1) H/P)`` and value heads ``[r HV/P, (r+1) HV/P)`` (value head ``i``
uses key head ``i // (HV/H)`` on every rank, as unsharded), the matching rows of its input
projections and conv channels (column-parallel: no communication), its share of ``A_log`` and
``dt_bias``, and the matching input columns of ``out_proj`` (row-parallel: one
``all_reduce`` of the ``[T, hidden]`` output). A :class:`~ssm_spec.RecoverShortConv` keeps channels
``[r C/P, (r+1) C/P)`` and all-gathers its output. Each rank's :class:`~ssm_spec.StatePool` then
holds only its own heads and channels; verify and commit need no communication. The collectives
are ``torch.distributed``'s (gloo on CPUs, NCCL on GPUs, which CUDA graphs can capture).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["tp_share", "shard_gdn_", "shard_short_conv_", "all_reduce_", "all_gather_channels"]


def tp_share(total: int, tp_group, what: str, owner: str) -> tuple[int, int]:
    """``(start, stop)`` of this rank's contiguous share of ``total`` items.

    Raises:
        ValueError: ``total`` not divisible by the group's size.
    """
    size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if total % size:
        raise ValueError(f"{owner}: {what}={total} is not divisible by the tensor-parallel size {size}")
    n = total // size
    return rank * n, (rank + 1) * n


def _linear(weight: torch.Tensor) -> nn.Linear:
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    lin.weight.requires_grad_(False)
    return lin


def shard_gdn_(layer, tp_group) -> None:
    """Cut a full :class:`~ssm_spec.RecoverGatedDeltaNet` down to this rank's heads, in place
    (new parameters: modules shared with a Hugging Face layer are replaced, not sliced).

    Raises:
        ValueError: ``H`` or ``HV`` not divisible by the group's size.
    """
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    owner = type(layer).__name__
    h0, h1 = tp_share(H, tp_group, "num_k_heads", owner)
    v0, v1 = tp_share(HV, tp_group, "num_v_heads", owner)
    g = HV // H
    # conv channels (and the qkv projection rows in the qwen3_5 layout): q | k | v
    conv_rows = torch.cat([torch.arange(h0 * K, h1 * K), H * K + torch.arange(h0 * K, h1 * K),
                           2 * H * K + torch.arange(v0 * V, v1 * V)])
    with torch.no_grad():
        if layer.layout == "qwen3_next":  # rows grouped per key head: [q k v z] of 2K + 2gV
            per = 2 * K + 2 * g * V
            layer.in_proj_qkvz = _linear(layer.in_proj_qkvz.weight[h0 * per:h1 * per])
            layer.in_proj_ba = _linear(layer.in_proj_ba.weight[h0 * 2 * g:h1 * 2 * g])
        else:
            layer.in_proj_qkv = _linear(layer.in_proj_qkv.weight[conv_rows.to(layer.in_proj_qkv.weight.device)])
            layer.in_proj_z = _linear(layer.in_proj_z.weight[v0 * V:v1 * V])
            layer.in_proj_b = _linear(layer.in_proj_b.weight[v0:v1])
            layer.in_proj_a = _linear(layer.in_proj_a.weight[v0:v1])
        w = layer.conv1d.weight[conv_rows.to(layer.conv1d.weight.device)]
        conv = nn.Conv1d(w.shape[0], w.shape[0], layer.conv_kernel_size, groups=w.shape[0],
                         padding=layer.conv_kernel_size - 1, bias=False, device=w.device, dtype=w.dtype)
        conv.weight.copy_(w)
        conv.weight.requires_grad_(False)
        layer.conv1d = conv
        layer.dt_bias = nn.Parameter(layer.dt_bias[v0:v1].clone(), requires_grad=False)
        layer.A_log = nn.Parameter(layer.A_log[v0:v1].clone(), requires_grad=False)
        layer.out_proj = _linear(layer.out_proj.weight[:, v0 * V:v1 * V])
    layer.num_k_heads, layer.num_v_heads = h1 - h0, v1 - v0
    layer.key_dim, layer.value_dim = layer.num_k_heads * K, layer.num_v_heads * V
    layer.conv_dim = 2 * layer.key_dim + layer.value_dim
    layer.tp_group = tp_group


def shard_short_conv_(layer, tp_group) -> None:
    """Cut a full :class:`~ssm_spec.RecoverShortConv` down to this rank's channels, in place.

    Raises:
        ValueError: ``C`` not divisible by the group's size.
    """
    c0, c1 = tp_share(layer.channels, tp_group, "channels", type(layer).__name__)
    with torch.no_grad():
        layer.weight = nn.Parameter(layer.weight[c0:c1].clone(), requires_grad=False)
        if layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias[c0:c1].clone(), requires_grad=False)
    layer.tp_channels, layer.channels = (c0, c1), c1 - c0
    layer.tp_group = tp_group


def all_reduce_(x: torch.Tensor, tp_group) -> torch.Tensor:
    """Sum ``x`` over the group in place (the row-parallel ``out_proj``); returns ``x``."""
    dist.all_reduce(x, group=tp_group)
    return x


def all_gather_channels(x: torch.Tensor, tp_group) -> torch.Tensor:
    """``[T, C/P]`` per rank -> ``[T, C]``, ranks' channel shares in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, x.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)
