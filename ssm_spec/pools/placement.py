"""Where a pool's states live: device names, the grouping of layers by device and shape, and
when launches must run under their group's device (docs/design.md section 5.9)."""

from __future__ import annotations

import torch

__all__ = ["CURRENT_DEVICE_TYPES", "needs_launch_guard", "placement_device", "group_layers"]


#: Device types whose ssm_spec kernels (Triton) launch on the *current* device of their type, not
#: on their tensors' device; a pool over several devices launches a group's ops there under
#: ``torch.cuda.device(group device)`` (:meth:`StatePool.launch_guard`). PyTorch's own ops take
#: their device from their tensors and need nothing.
CURRENT_DEVICE_TYPES = ("cuda",)


def needs_launch_guard(devices) -> bool:
    """Whether a pool on ``devices`` (its :attr:`StatePool.devices`) launches under its groups'
    devices: when it spans several devices, one of a type in :data:`CURRENT_DEVICE_TYPES`, or
    when its one device is a GPU other than the current one as it is made (a model placed on
    ``cuda:1`` alone by a device map, run while ``cuda:0`` is current). A pool on the current
    GPU, or on the CPU, launches as it is: nothing in the way of its captured or compiled step."""
    devices = tuple(devices)
    if len(devices) > 1:
        return any(d.type in CURRENT_DEVICE_TYPES for d in devices)
    return devices[0].type == "cuda" and devices[0].index != torch.cuda.current_device()



def placement_device(device) -> torch.device:
    """``device`` (a ``torch.device``, a string such as ``"cuda:1"``, or an accelerator index)
    as the one ``torch.device`` that names it in a pool's group keys: ``"cuda"`` (no index)
    becomes the current CUDA device (``cuda:0`` where CUDA is absent), ``"cpu:0"`` becomes
    ``"cpu"``, an int ``i`` becomes ``cuda:i``. Needs no GPU.

    Raises:
        ValueError: not a device.
    """
    if isinstance(device, bool):
        raise ValueError(f"StatePool: device: got {device!r}; expected a torch.device, a string or an index")
    if isinstance(device, int):
        return torch.device("cuda", device)
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"StatePool: device: got {device!r}; expected a torch.device, a string or an index "
                         f"({exc})") from None
    if d.type == "cpu":
        return torch.device("cpu") if d.index is not None else d
    if d.index is None and d.type != "meta":
        index = torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_available() else 0
        return torch.device(d.type, index)
    return d


def group_layers(layers, devices) -> dict:
    """The pool's grouping: ``{(kind, device, spec): [layer, ...]}`` over every state of every
    layer (``kind``: ``"gdn"`` or ``"conv"``; ``spec``: its :class:`GDNStateSpec` /
    :class:`ConvStateSpec`), groups and members in order of first appearance. Layers on two
    devices never share a group; layers of two shapes never do either.

    Args:
        layers: modules with ``state_specs()``.
        devices: one device per layer (anything :func:`placement_device` takes).

    Raises:
        ValueError: ``devices`` not one per layer, or not devices.
    """
    layers, devices = list(layers), list(devices)
    if len(devices) != len(layers):
        raise ValueError(f"StatePool: device: got {len(devices)} devices for {len(layers)} layers; expected one "
                         "device, or one per layer")
    groups: dict = {}
    for layer, device in zip(layers, devices):
        d = placement_device(device)
        for kind, spec in layer.state_specs():
            groups.setdefault((kind, d, spec), []).append(layer)
    return groups


