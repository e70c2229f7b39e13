"""Eager calls of the ssm_spec ops that skip torch.library's Python dispatch layers.

An op defined with ``torch.library.custom_op`` runs Python wrappers on every call
(ADInplaceOrView with ``fill_defaults``, the autograd wrapper) before its kernel, measured
costly on the CPU (docs/perf-notes.md, "Host overhead: custom-op dispatch"). The modules make
several op calls per layer and step, so on a host-bound batch-1 decode this is visible.
``call`` runs the op's registered backend function directly in eager mode and the registered
op (``torch.ops.ssm_spec.<name>``) while compiling, so traced graphs keep the op and its
mutation annotations. Both paths run the same structure checks and the same kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["call", "register"]

_KERNELS: dict[str, dict[str, Callable]] = {}


def register(name: str, **kernels: Callable) -> None:
    """Record the backend functions of op ``name`` by device type (``cpu=...``, ``cuda=...``)."""
    _KERNELS[name] = kernels


def call(name: str, *args) -> None:
    """Run op ``name`` on ``args`` (its schema's positional arguments; the first is a tensor on
    the op's device): the backend function in eager mode, ``torch.ops.ssm_spec.<name>`` while
    compiling or for a device type without a recorded function."""
    if not torch.compiler.is_compiling():
        kernel = _KERNELS[name].get(args[0].device.type)
        if kernel is not None:
            return kernel(*args)
    return getattr(torch.ops.ssm_spec, name)(*args)
