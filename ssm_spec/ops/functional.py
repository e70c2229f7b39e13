"""Functional forms of the verify ops: they return their outputs and mutate nothing.

For compilers that cannot take in-place ops (``torch.export`` consumers such as
Torch-TensorRT): ``torch.ops.ssm_spec.gdn_verify_functional`` and
``torch.ops.ssm_spec.short_conv_verify_functional`` allocate their outputs (zero-filled, so
tokens outside every window read 0 instead of uninitialised memory) and run the in-place
op's kernel on them. The commit stays in place (it exists to write the pool) and runs in
PyTorch beside whatever runs the verify.
"""

from __future__ import annotations

import torch

from . import _eager
from ._library import define_op

__all__ = ["gdn_verify_functional", "short_conv_verify_functional"]


def _gdn_outputs(q, v, new=torch.zeros):
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    f32 = dict(dtype=torch.float32, device=v.device)
    return (new((T, HV, V), dtype=v.dtype, device=v.device), new((T, HV, V), **f32), new((T, H, K), **f32),
            new((T, HV), **f32))


def _gdn_fake(q, k, v, g, beta, state, state_indices, query_start_loc, scale, use_qk_l2norm):
    return _gdn_outputs(q, v, new=torch.empty)


@define_op("gdn_verify_functional", mutates_args=(), fake=_gdn_fake)
def gdn_verify_functional(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
    scale: float, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gdn_verify`` returning ``(out [T, HV, V] in v's dtype, rec_u [T, HV, V] f32,
    rec_k [T, H, K] f32, rec_decay [T, HV] f32)``; arguments and errors as
    :func:`ssm_spec.ops.gdn_verify` (no value validation: the op form). ``state`` is read only."""
    out, rec_u, rec_k, rec_decay = _gdn_outputs(q, v)
    _eager.call("gdn_verify", q, k, v, g, beta, state, state_indices, query_start_loc, out, rec_u, rec_k,
                rec_decay, scale, use_qk_l2norm)
    return out, rec_u, rec_k, rec_decay


def _short_conv_fake(x, weight, bias, conv_state, state_indices, query_start_loc, dilation, activation):
    return torch.empty_like(x), torch.empty(x.shape, dtype=torch.float32, device=x.device)


@define_op("short_conv_verify_functional", mutates_args=(), fake=_short_conv_fake)
def short_conv_verify_functional(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    state_indices: torch.Tensor, query_start_loc: torch.Tensor, dilation: int, activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``short_conv_verify`` returning ``(out [T, C] in x's dtype, rec_x [T, C] f32)``;
    arguments as :func:`ssm_spec.ops.short_conv_verify`. ``conv_state`` is read only."""
    out = torch.zeros_like(x)
    rec_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    _eager.call("short_conv_verify", x, weight, bias, conv_state, state_indices, query_start_loc, out, rec_x,
                dilation, activation)
    return out, rec_x
