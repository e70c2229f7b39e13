"""Where a converted model's layers run: device maps and accelerate's hooks (docs/design.md
section 5.9).

A model loaded with ``from_pretrained(..., device_map=...)`` or placed by
``accelerate.dispatch_model`` carries accelerate hooks (``module._hf_hook``): each one moves a
module's inputs to its ``execution_device`` and, for weights offloaded to the CPU or the disk,
loads them there for the forward and drops them after (they sit on the ``meta`` device
between forwards). This module answers what the converted model needs to know about that:
the device each converted layer runs on (its states go there), whether the placement lets a
CUDA graph hold the forward, and how a converted layer keeps the hooks of the layer it
replaces. accelerate itself is imported only where a hook is present.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from ..pools import placement_device

__all__ = ["execution_device", "layer_devices", "placement_problem", "carry_hook", "hook_loaded"]


def _hooks(module: nn.Module):
    """The accelerate hooks on ``module`` itself (a ``SequentialHook``'s members in order)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return ()
    return tuple(getattr(hook, "hooks", (hook,)))


def execution_device(module: nn.Module) -> torch.device | None:
    """The device ``module``'s forward runs on: the ``execution_device`` of an accelerate hook on
    it, else the device of its first parameter that is not on ``meta`` (a module without hooks
    runs where its weights are), else ``None`` (it does not say).

    Under a device map the converted layer carries the hook of the layer it replaced
    (:func:`carry_hook`): for a layer offloaded to the CPU or the disk that is the device its
    weights are loaded to for each forward (accelerate's main device), not the CPU.
    """
    for hook in _hooks(module):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return placement_device(device)
    for p in module.parameters():
        if p.device.type != "meta":
            return placement_device(p.device)
    return None


def layer_devices(layers, fallback) -> list[torch.device]:
    """The ``device`` argument of the pool that holds ``layers``' states: one ``torch.device``
    per layer, always a list (a :class:`~ssm_spec.StatePool` given the same device for every
    layer is a pool on that one device).

    Args:
        layers: the converted layers, in model order.
        fallback: the device of the first forward's hidden states (anything
            :func:`~ssm_spec.pools.placement_device` takes), for a layer that names no device.

    Returns:
        Each layer's :func:`execution_device`, or ``fallback`` where it names none. Layers that
        all name one device get that device, whatever ``fallback`` is: a model whose GDN layers
        all run on ``cuda:1`` while its inputs arrive on ``cuda:0`` keeps their states on
        ``cuda:1``.
    """
    fallback = placement_device(fallback)
    return [fallback if d is None else d for d in map(execution_device, layers)]


def placement_problem(model: nn.Module) -> str | None:
    """Why a CUDA graph cannot hold ``model``'s forward as the model is placed, or ``None``.

    A graph captures the work of one device with its inputs at fixed addresses. It cannot hold
    a forward whose modules run on several devices (a device map over GPUs, or a GPU and the
    CPU: the CPU's work is not replayed, another GPU's is not captured), nor one that loads
    offloaded weights (accelerate's ``"cpu"`` / ``"disk"`` entries) into fresh tensors each
    forward. One pass over the modules; no device work.
    """
    devices = set()
    for name, module in model.named_modules():
        for hook in _hooks(module):
            if getattr(hook, "offload", False):
                return (f"accelerate offloads the weights of {name or type(model).__name__} (a device map's 'cpu' "
                        "or 'disk' entry) and loads them for every forward")
            device = getattr(hook, "execution_device", None)
            if device is not None:
                devices.add(placement_device(device))
        for p in module.parameters(recurse=False):
            if p.device.type != "meta":
                devices.add(placement_device(p.device))
    if len(devices) > 1:
        return f"its layers run on {', '.join(sorted(map(str, devices)))} (a device map)"
    return None


def _copy_hook(hook):
    """A copy of an accelerate hook (a ``SequentialHook``: of each member), so that attaching
    it to another module leaves ``hook`` as it was."""
    members = getattr(hook, "hooks", None)
    if members is not None:
        return type(hook)(*(_copy_hook(h) for h in members))
    new = copy.copy(hook)
    if isinstance(getattr(hook, "tied_params_names", None), set):
        new.tied_params_names = set(hook.tied_params_names)
    return new


def carry_hook(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (a converted layer) a copy of the accelerate hook of ``old`` (the layer it
    replaces), if ``old`` has one and ``new`` has none: its inputs go to the same execution
    device, and the weights it owns directly (``A_log``, ``dt_bias``, under the same names) are
    loaded and offloaded as ``old``'s were. Submodules are shared and keep their own hooks.

    A copy, not the hook itself: attaching a hook runs its ``init_hook``, which for an
    offloading hook records the module's current weight devices as ``original_devices`` (the
    devices ``remove_hook_from_module`` restores the weights to). The converted layer's weights
    are already offloaded (``meta``), so the copy keeps the old hook's record instead, and
    removing the hooks brings ``A_log`` and ``dt_bias`` back as it would have for ``old``.
    """
    hook = getattr(old, "_hf_hook", None)
    if hook is None or getattr(new, "_hf_hook", None) is not None:
        return
    from accelerate.hooks import add_hook_to_module

    carried = _copy_hook(hook)
    add_hook_to_module(new, carried)
    pairs = zip(getattr(hook, "hooks", (hook,)), getattr(carried, "hooks", (carried,)))
    for was, now in pairs:  # init_hook recorded the converted layer's (offloaded) devices: keep old's
        if isinstance(getattr(was, "original_devices", None), dict):
            now.original_devices = dict(was.original_devices)


@contextmanager
def hook_loaded(module: nn.Module):
    """Run ``module``'s accelerate hook around a block that reads its weights without calling
    it (the converted layer reads ``conv1d.weight`` for its kernels): an offloading hook loads
    them to the execution device first and offloads them after. No-op without a hook."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        yield
        return
    hook.pre_forward(module)
    try:
        yield
    finally:
        hook.post_forward(module, None)
