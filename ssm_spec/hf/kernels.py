"""Which kernels transformers' own Qwen3-Next / Qwen3.5 GDN layers run, and a switch to its
PyTorch reference functions.

transformers binds ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``causal_conv1d_fn`` and ``causal_conv1d_update`` in its modeling modules through
``use_kernel_func_from_hub_with_fallback``: where fla-core / causal-conv1d are installed they
dispatch to those, on any device. The tests compare our layers with transformers' reference
path; the HF benchmark times transformers both ways.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

__all__ = ["HF_MODELING", "HF_KERNEL_FUNCTIONS", "hf_reference_kernels"]

#: The transformers model families whose GDN layers we convert (every class of
#: ``ssm_spec.hf.tiny.KINDS`` lives in one of them; Qwen3.5-MoE binds its own copies).
HF_MODELING = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
#: The module-level functions their GDN layers look up at call time.
HF_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                       "causal_conv1d_update")


@contextlib.contextmanager
def hf_reference_kernels():
    """Inside the block, transformers' GDN layers run their PyTorch reference functions.

    Each wrapped function is replaced by ``inspect.unwrap`` of itself and put back on exit
    (also on an error). The layers look the names up at call time, so this applies to models
    already built. Yields the ``family.function`` names replaced (none where nothing is
    wrapped, e.g. a transformers without the hub-kernel decorator).
    """
    saved = []
    try:
        for name in HF_MODELING:
            try:
                mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            except ImportError:
                continue
            for fn in HF_KERNEL_FUNCTIONS:
                wrapped = getattr(mod, fn, None)
                if wrapped is None or inspect.unwrap(wrapped) is wrapped:
                    continue
                saved.append((name, mod, fn, wrapped))
                setattr(mod, fn, inspect.unwrap(wrapped))
        yield [f"{name}.{fn}" for name, _, fn, _ in saved]
    finally:
        for _, mod, fn, wrapped in reversed(saved):
            setattr(mod, fn, wrapped)
