"""One definition per op: the ``torch.library`` custom op, its kernels, its fake and the eager path.

An in-place ssm_spec op is written once, as ``body(kernel, *args)``: its structure checks (no
host sync), then a call of ``kernel``, which is the op's CPU twin on CPU tensors and its Triton
launcher on CUDA ones. :func:`define_op` turns it into ``torch.ops.ssm_spec.<name>``, whose
schema is that of ``body``'s annotated arguments after ``kernel``: the CPU form is the op's
default kernel (every device type without one of its own, as ``torch.library.custom_op`` does),
the CUDA form its CUDA kernel; the fake (meta) implementation returns nothing (the op only
writes its mutated arguments); and both forms are recorded for :func:`ssm_spec.ops._eager.call`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch._dynamo  # noqa: F401  (see below)

from . import _eager

# A custom op's kernels run under torch._disable_dynamo, which imports torch._dynamo on the op's
# first call: 1-1.5 s on an idle 2-core CPU, several seconds on a busy one, inside the first
# ops.gdn_verify. Importing it here moves that cost to `import ssm_spec`, where a caller expects
# it (transformers' generate imports it anyway).

__all__ = ["define_op"]


def _no_outputs(*args, **kwargs) -> None:
    return None


def _with_kernel(body: Callable, kernel: Callable, signature: inspect.Signature) -> Callable:
    """``body`` with its first argument fixed to ``kernel``, under the op's ``signature``."""

    def run(*args, **kwargs):
        return body(kernel, *args, **kwargs)

    run.__signature__ = signature
    run.__name__ = run.__qualname__ = f"{body.__name__}[{kernel.__name__}]"
    run.__module__, run.__doc__ = body.__module__, body.__doc__
    return run


def define_op(name: str, *, mutates_args: tuple[str, ...], cpu: Callable | None = None,
              cuda: Callable | None = None, fake: Callable | None = None) -> Callable:
    """Decorator: register ``body`` as ``torch.ops.ssm_spec.<name>``; returns the
    ``torch.library.CustomOpDef``.

    With ``cpu`` and ``cuda`` (the in-place ops), ``body(kernel, *args)`` runs ``kernel =
    cpu`` as the default kernel and ``kernel = cuda`` as the CUDA kernel, both recorded for the
    eager path, and the fake returns None. Without them (the functional forms), ``body(*args)``
    is the op's kernel on every device and ``fake`` its fake.
    """

    def register(body: Callable) -> torch.library.CustomOpDef:
        if cpu is None:
            op = torch.library.custom_op(f"ssm_spec::{name}", mutates_args=mutates_args)(body)
        else:
            signature = inspect.signature(body, eval_str=True)
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
            on_cpu, on_cuda = _with_kernel(body, cpu, signature), _with_kernel(body, cuda, signature)
            op = torch.library.custom_op(f"ssm_spec::{name}", mutates_args=mutates_args)(on_cpu)
            op.register_kernel("cuda")(on_cuda)
            _eager.register(name, cpu=on_cpu, cuda=on_cuda)
        op.register_fake(fake or _no_outputs)
        return op

    return register
