"""The projections back to the residual stream as inductor's GEMV in a compiled one-row step.

A decode step at batch 1 multiplies one row by each weight. For the projections whose output is
the model's ``hidden_size`` and whose input is wider (GDN's ``out_proj``, attention's ``o_proj``,
the MLPs' ``down_proj``: 2,560 outputs over 4,096 or 9,216 inputs at the 3.6 B Qwen3.5 width),
cuBLAS reaches 0.59-0.80 of the copy bandwidth, while the same product written as a broadcast
multiply and a sum over the inputs, which inductor compiles into one Triton reduction, reaches
0.76-0.95 (``benchmarks/bench_gemv.py``, one-row GEMMs in CUDA graphs over cold weights, H100,
bf16; ``docs/perf-notes.md``). At four rows (the other count measured) and on the wide
projections cuBLAS is the faster (the reduction form reads the weight once per row), so only
the one-row case changes.

:func:`use_narrow_gemv` makes those linears :class:`NarrowLinear` (the class swapped in place: the
same parameters, names, ``state_dict`` and ``save_pretrained``); its forward takes the reduction
form exactly when :func:`narrow_gemv_applies` (while ssm-spec's own inductor-compiled forwards
trace, :func:`inductor_forms`; CUDA; bfloat16 or float16; one row) and is ``nn.Linear``'s
otherwise, bit for bit: eager calls, a caller's own ``torch.compile`` (whose backend may not
fuse the product: an eager backend would build the ``[N, K]`` float32 product), float32 models
(whose exactness tests compare bits) and every CPU run are untouched.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .fused_linear import plain_resident_linear

__all__ = ["NarrowLinear", "NARROW_NAMES", "narrow_gemv", "narrow_gemv_applies", "inductor_forms",
           "use_narrow_gemv", "drop_narrow_gemv"]

#: Names of the projections back to the residual stream (GDN, attention, dense and shared-expert MLPs).
NARROW_NAMES = ("out_proj", "o_proj", "down_proj")
#: Where the form applies: the devices and dtypes it was measured faster on.
DEVICES = ("cuda",)
DTYPES = (torch.bfloat16, torch.float16)

_inductor_trace = False  # True while ssm-spec's own inductor-compiled forwards run (inductor_forms)


@contextlib.contextmanager
def inductor_forms():
    """Let :class:`NarrowLinear` take the reduction form while this block runs ``torch.compile``'d
    code with the inductor backend (the decode loop's compiled forwards,
    :func:`ssm_spec.hf.loop.forward.compiled`). Dynamo guards on the switch, so a graph traced
    inside the block is not reused outside it."""
    global _inductor_trace
    before, _inductor_trace = _inductor_trace, True
    try:
        yield
    finally:
        _inductor_trace = before


def narrow_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :class:`NarrowLinear` computes ``x [..., K] @ weight [N, K]^T`` as a reduction:
    while tracing under :func:`inductor_forms` (the form is inductor's kernel, not an eager
    one), on a device of :data:`DEVICES`, in a dtype of :data:`DTYPES` (the measured case;
    float32 keeps cuBLAS's bits), for one row."""
    return (_inductor_trace and torch.compiler.is_compiling() and x.device.type in DEVICES
            and x.dtype in DTYPES and weight.dtype == x.dtype and x.numel() == x.shape[-1])


def narrow_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row as a broadcast multiply and a float32 sum over ``K``.

    Args:
        x: ``[..., K]`` holding one row (``x.numel() == K``), float dtype.
        weight: ``[N, K]`` of ``x``'s dtype and device.
        bias: ``[N]`` or ``None``.

    Returns:
        ``[..., N]`` in ``x``'s dtype: the product (and bias) accumulated in float32 and rounded
        once (within the dtype's rounding of ``F.linear``; not its bits).

    Raises:
        ValueError: ``x`` holds more than one row, or its last dimension is not ``weight``'s.
    """
    K = weight.shape[-1]
    if x.shape[-1] != K or x.numel() != K:
        raise ValueError(f"narrow_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}; expected one row of "
                         f"{K} inputs")
    y = (x.reshape(1, 1, K).float() * weight[None].float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


class NarrowLinear(nn.Linear):
    """An ``nn.Linear`` back to the residual stream (swapped in by :func:`use_narrow_gemv`):
    ``forward(x [..., in_features]) -> [..., out_features]`` by :func:`narrow_gemv` where
    :func:`narrow_gemv_applies`, else ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if narrow_gemv_applies(x, self.weight):
            return narrow_gemv(x, self.weight, self.bias)
        return super().forward(x)


def use_narrow_gemv(model: nn.Module) -> int:
    """Make ``model``'s projections back to the residual stream :class:`NarrowLinear` (in place).

    A module counts when it is named as in :data:`NARROW_NAMES`, is a plain, resident
    ``nn.Linear`` (:func:`~ssm_spec.hf.fused_linear.plain_resident_linear`: not a subclass,
    quantized or already swapped; no tensor-subclass or ``meta`` weights; no accelerate hook of
    its own, which would call the class's forward it saw), has the text config's
    ``hidden_size`` outputs (where the model has a config) and more inputs than outputs.
    Returns the number swapped."""
    config = getattr(model, "config", None)
    hidden = config.get_text_config().hidden_size if config is not None else None
    count = 0
    for name, module in model.named_modules():
        if (name.rsplit(".", 1)[-1] in NARROW_NAMES and plain_resident_linear(module)
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
