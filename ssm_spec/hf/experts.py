"""Expert layers under CUDA graphs: the converted model switches transformers' experts
implementation to one whose routing never waits for the host, and back."""

from __future__ import annotations

from torch import nn

__all__ = ["CAPTURE_SAFE_EXPERTS", "capture_safe_experts"]

#: The expert implementation ``cuda_graphs=True`` selects: transformers' ``batched_mm`` gathers
#: each token's top-k experts' weights by index and multiplies them in one batched product, so
#: routing stays on the device with shapes fixed by the token count (no ``nonzero``, no host
#: sync), where the default ``eager`` loops over the experts that received tokens and
#: ``grouped_mm`` sizes its groups from the routing.
CAPTURE_SAFE_EXPERTS = "batched_mm"


def capture_safe_experts(model: nn.Module, on: bool) -> None:
    """Switch a converted model's mixture-of-experts layers to :data:`CAPTURE_SAFE_EXPERTS` when
    CUDA graphs are turned on, and back to the model's own setting when they are turned off.

    Uses transformers' experts-implementation switch (``set_experts_implementation``, present
    in 5.17 and later); models without expert layers, or a transformers without the switch,
    are left as they are. The original setting is kept in the model's runtime state.
    """
    if not hasattr(model, "set_experts_implementation") or not any(
            type(m).__name__.endswith("Experts") for m in model.modules()):
        return
    runtime = model._recoverssm
    if on and runtime.experts_implementation is None:
        runtime.experts_implementation = model.get_experts_implementation()
        model.set_experts_implementation(CAPTURE_SAFE_EXPERTS)
    elif not on and runtime.experts_implementation is not None:
        model.set_experts_implementation(runtime.experts_implementation)
        runtime.experts_implementation = None
