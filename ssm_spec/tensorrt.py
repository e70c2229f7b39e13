"""Torch-TensorRT path for the exported verify step (extra ``tensorrt``).

Written against Torch-TensorRT's documented dynamo API (``torch_tensorrt.dynamo.compile`` on a
``torch.export`` program; ``torch_tensorrt.dynamo.conversion.plugins.custom_op``, the
TensorRT >= 10.7 Quick Deployable Plugin path that wraps a PyTorch/Triton custom op as a
TensorRT plugin; ``torch_executed_ops`` to leave an op to PyTorch). TensorRT cannot be
installed in this project's test environments, so this module is exercised only where
``torch_tensorrt`` imports (its tests skip otherwise, saying so); the export it consumes is
tested everywhere (:mod:`ssm_spec.export`).

* :func:`register_plugins` turns the functional verify ops into TensorRT plugins where the
  installed Torch-TensorRT and TensorRT support it, and reports which ones stay in PyTorch.
* :func:`compile_verify` compiles an exported :class:`~ssm_spec.export.VerifyForward`: ops
  with a plugin run inside the engine, the others as PyTorch islands (``torch_executed_ops``).
* The commit always runs in PyTorch (it mutates the pool); :func:`capture_verify_and_commit`
  records the compiled verify and a commit in one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ssm_spec.capture import collection_paused

__all__ = ["FUNCTIONAL_VERIFY_OPS", "available", "register_plugins", "compile_verify", "capture_verify_and_commit"]

#: The ops a verify program holds (``torch.ops.ssm_spec.<name>.default``).
FUNCTIONAL_VERIFY_OPS = ("gdn_verify_functional", "short_conv_verify_functional")

_REGISTERED: dict[str, str] = {}


def available() -> tuple[bool, str]:
    """``(True, version)`` if ``torch_tensorrt`` imports, else ``(False, why)``."""
    try:
        import torch_tensorrt
    except Exception as exc:  # ImportError, or a broken install (missing TensorRT libraries)
        return False, f"torch_tensorrt is not importable ({type(exc).__name__}: {exc})"
    return True, getattr(torch_tensorrt, "__version__", "unknown")


def register_plugins(ops=FUNCTIONAL_VERIFY_OPS) -> dict[str, str]:
    """Register each op as a TensorRT plugin (once per process).

    Returns:
        ``{op: "plugin"}`` for each op registered, ``{op: "pytorch: <why>"}`` for each that
        stays in PyTorch (no plugin API in this Torch-TensorRT / TensorRT, or it refused the
        op: e.g. a tuple output it cannot describe).

    Raises:
        ImportError: ``torch_tensorrt`` is not installed.
    """
    import torch_tensorrt

    plugins = getattr(getattr(torch_tensorrt.dynamo, "conversion", None), "plugins", None)
    for op in ops:
        if op in _REGISTERED:
            continue
        if plugins is None or not hasattr(plugins, "custom_op"):
            _REGISTERED[op] = "pytorch: torch_tensorrt.dynamo.conversion.plugins.custom_op is not available"
            continue
        try:
            plugins.custom_op(f"ssm_spec::{op}", supports_dynamic_shapes=True, requires_output_allocator=False)
            _REGISTERED[op] = "plugin"
        except Exception as exc:  # the plugin system rejects the op: fall back to PyTorch
            _REGISTERED[op] = f"pytorch: {type(exc).__name__}: {exc}"
    return {op: _REGISTERED[op] for op in ops}


def compile_verify(exported_program, inputs, *, use_plugins: bool = True, **compile_kwargs):
    """Compile an exported verify program with Torch-TensorRT.

    Args:
        exported_program: from :func:`ssm_spec.export.export_verify`.
        inputs: example inputs (the exported program's flat argument list) or
            ``torch_tensorrt.Input`` specs with min/opt/max shapes for the dynamic dims.
        use_plugins: try :func:`register_plugins` first; ``False`` leaves every ssm_spec op
            to PyTorch.
        compile_kwargs: passed to ``torch_tensorrt.dynamo.compile`` (``min_block_size``
            defaults to 1).

    Returns:
        ``(module, placement)``: the compiled module and ``{op: "plugin" | "pytorch: why"}``.

    Raises:
        ImportError: ``torch_tensorrt`` is not installed; whatever Torch-TensorRT raises.
    """
    import torch_tensorrt

    placement = register_plugins() if use_plugins else {op: "pytorch: plugins not requested"
                                                       for op in FUNCTIONAL_VERIFY_OPS}
    in_pytorch = {f"torch.ops.ssm_spec.{op}.default" for op, where in placement.items() if where != "plugin"}
    compile_kwargs.setdefault("min_block_size", 1)
    try:
        module = torch_tensorrt.dynamo.compile(exported_program, inputs=inputs, torch_executed_ops=in_pytorch,
                                               **compile_kwargs)
    except Exception as exc:
        if len(in_pytorch) == len(FUNCTIONAL_VERIFY_OPS):
            raise
        # a registered plugin that fails to convert inside the engine: every op to PyTorch
        placement = {op: f"pytorch: its plugin failed to convert ({type(exc).__name__}: {exc})"
                     if where == "plugin" else where for op, where in placement.items()}
        module = torch_tensorrt.dynamo.compile(
            exported_program, inputs=inputs,
            torch_executed_ops={f"torch.ops.ssm_spec.{op}.default" for op in FUNCTIONAL_VERIFY_OPS}, **compile_kwargs)
    return module, placement


def capture_verify_and_commit(verify: Callable, commit: Callable, static_args, warmup: int = 2):
    """Capture ``records = verify(*static_args)`` then ``commit(records)`` in one CUDA graph.

    ``verify`` is the compiled verify (or any capture-safe callable), ``commit`` writes the
    pool from its outputs (e.g. :func:`ssm_spec.export.commit_records` with ``validate=False``
    on device-side counts). Inputs must stay in ``static_args`` (copy new values into them
    between replays). The warm-up runs ``verify`` only (a commit would change the pool): run
    one real step's ``commit`` eagerly before capturing, so its kernels are compiled, since
    compiling inside a capture fails.

    Returns:
        ``(graph, outputs)``: replay with ``graph.replay()``; ``outputs`` are the captured
        verify outputs, refreshed by every replay.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):  # compile / allocate outside the capture (commits write too)
            verify(*static_args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collection_paused(), torch.cuda.graph(graph):  # a graph collected inside would end the capture
        outputs = verify(*static_args)
        commit(outputs)
    return graph, outputs
