"""What an HF benchmark run ran on: the package versions and the device, and the module each GDN
kernel of the unconverted model resolved to (fla-core's, causal-conv1d's or transformers' own)."""

from __future__ import annotations

import importlib.util
import platform
import sys

import torch
from _results import device_name


def package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def _implementation(fn):
    """The function a transformers fallback wrapper dispatches to (its ``implementation`` free
    variable, through ``__wrapped__`` chains), or ``fn`` itself."""
    seen = 0
    while fn is not None and seen < 8:
        code = getattr(fn, "__code__", None)
        cells = dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}
        if "implementation" in cells:
            try:
                return cells["implementation"].cell_contents
            except ValueError:  # an empty cell
                return fn
        if getattr(fn, "__wrapped__", None) is None:
            return fn
        fn, seen = fn.__wrapped__, seen + 1
    return fn


def kernel_sources(model) -> dict:
    """Best effort: the module each GDN kernel of the unconverted model comes from (fla,
    causal_conv1d, or transformers' torch fallback), read from the layer's attributes or the
    modeling module's functions, unwrapping transformers' hub/fallback wrappers."""
    layer = next((m for m in model.modules() if hasattr(m, "A_log")), None)
    if layer is None:
        return {}
    modeling = sys.modules.get(type(layer).__module__)
    out = {}
    for name in ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        fn = None
        for candidate in (name, f"torch_{name}"):
            fn = getattr(layer, candidate, None) or getattr(modeling, candidate, None)
            if fn is not None:
                break
        if fn is None:
            continue
        impl = _implementation(fn)
        out[name] = f"{getattr(impl, '__module__', None) or type(impl).__name__}.{getattr(impl, '__name__', '?')}"
    fast = getattr(modeling, "is_fast_path_available", None)
    if fast is not None:
        out["is_fast_path_available"] = bool(fast)
    return out


def environment(device: torch.device) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "cuda": torch.version.cuda,
        "fla_core": package_version("fla-core") or package_version("flash-linear-attention"),
        "fla_importable": importlib.util.find_spec("fla") is not None,
        "causal_conv1d_importable": importlib.util.find_spec("causal_conv1d") is not None,
        "triton": package_version("triton"),
    }
    env["device"] = device_name(device)
    if device.type == "cuda":
        env["driver_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def same_kernels_why(kernels: dict | None) -> str:
    """Why ``hf-torch`` ran ``hf``'s kernels (``kernels``: name -> source, as ``kernel_sources``
    reports them): fla-core's left bound (the family was not unwrapped), or no fla-core at all."""
    fla = any(str(v).startswith("fla.") for v in (kernels or {}).values())
    return ("fla-core's: this family's functions were not unwrapped" if fla
            else "transformers' PyTorch functions; no fla-core kernels bound")
