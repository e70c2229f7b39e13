"""The projections back to the residual stream as inductor's GEMV in a compiled one-row step.

A decode step at batch 1 multiplies one row by each weight. For the projections whose output is
the model's ``hidden_size`` and whose input is wider (GDN's ``out_proj``, attention's ``o_proj``,
the MLPs' ``down_proj``: 2,560 outputs over 4,096 or 9,216 inputs at the 3.6 B Qwen3.5 width),
cuBLAS reaches 0.59-0.80 of the copy bandwidth, while the same product written as a broadcast
multiply and a sum over the inputs, which inductor compiles into one Triton reduction, reaches
0.76-0.95 (``benchmarks/bench_gemv.py``, one-row GEMMs in CUDA graphs over cold weights, H100,
bf16; ``docs/perf-notes.md``). At two rows and more, and on the wide projections, cuBLAS is the
faster (the reduction form reads the weight once per row), so only this case changes.

:func:`use_narrow_gemv` makes those linears :class:`NarrowLinear` (the class swapped in place: the
same parameters, names, ``state_dict`` and ``save_pretrained``); its forward takes the reduction
form exactly when :func:`narrow_gemv_applies` (inside ``torch.compile``, CUDA, bfloat16 or
float16, one row) and is ``nn.Linear``'s otherwise, bit for bit: eager calls, float32 models
(whose exactness tests compare bits) and every CPU run are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NarrowLinear", "NARROW_NAMES", "narrow_gemv", "narrow_gemv_applies", "use_narrow_gemv",
           "drop_narrow_gemv"]

#: Names of the projections back to the residual stream (GDN, attention, dense and shared-expert MLPs).
NARROW_NAMES = ("out_proj", "o_proj", "down_proj")


def narrow_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :class:`NarrowLinear` computes ``x [..., K] @ weight [N, K]^T`` as a reduction:
    inside ``torch.compile`` (the form is inductor's kernel, not an eager one), on CUDA, in
    bfloat16 or float16 (the measured case; float32 keeps cuBLAS's bits), for one row."""
    return (torch.compiler.is_compiling() and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.numel() == x.shape[-1])


def narrow_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for one row as a broadcast multiply and a float32 sum over ``K``.

    Args:
        x: ``[..., K]`` holding one row (``x.numel() == K``), float dtype.
        weight: ``[N, K]`` of ``x``'s dtype and device.

    Returns:
        ``[..., N]`` in ``x``'s dtype: the product accumulated in float32 and rounded once
        (within the dtype's rounding of ``F.linear``; not its bits).

    Raises:
        ValueError: ``x`` holds more than one row, or its last dimension is not ``weight``'s.
    """
    K = weight.shape[-1]
    if x.shape[-1] != K or x.numel() != K:
        raise ValueError(f"narrow_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}; expected one row of "
                         f"{K} inputs")
    y = (x.reshape(1, 1, K).float() * weight[None].float()).sum(-1)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


class NarrowLinear(nn.Linear):
    """An ``nn.Linear`` back to the residual stream (swapped in by :func:`use_narrow_gemv`):
    ``forward(x [..., in_features]) -> [..., out_features]`` by :func:`narrow_gemv` where
    :func:`narrow_gemv_applies`, else ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not narrow_gemv_applies(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        y = narrow_gemv(x, self.weight)
        return y if self.bias is None else y + self.bias


def use_narrow_gemv(model: nn.Module) -> int:
    """Make ``model``'s projections back to the residual stream :class:`NarrowLinear` (in place).

    A module counts when it is a plain ``nn.Linear`` (not a subclass: quantized or already
    swapped) named as in :data:`NARROW_NAMES`, with the text config's ``hidden_size`` outputs
    (where the model has a config) and more inputs than outputs. Returns the number swapped."""
    config = getattr(model, "config", None)
    hidden = config.get_text_config().hidden_size if config is not None else None
    count = 0
    for name, module in model.named_modules():
        if (type(module) is nn.Linear and name.rsplit(".", 1)[-1] in NARROW_NAMES
                and module.in_features > module.out_features and hidden in (None, module.out_features)):
            module.__class__ = NarrowLinear
            count += 1
    return count


def drop_narrow_gemv(model: nn.Module) -> int:
    """Undo :func:`use_narrow_gemv`: every :class:`NarrowLinear` gets ``nn.Linear`` back. Returns
    the number restored."""
    found = [m for m in model.modules() if type(m) is NarrowLinear]
    for m in found:
        m.__class__ = nn.Linear
    return len(found)
