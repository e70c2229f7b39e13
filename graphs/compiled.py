"""The ``torch.compile`` path of the uniform spec-decode step (docs/design.md section 6).

:func:`compile_step` binds :func:`ssm_spec.graphs.step.spec_decode_step` to a model and its pool and
compiles it whole (``fullgraph=True``: no graph break). The pool's states and records and the
model's buffers are marked as static addresses, so ``mode="reduce-overhead"`` records the
step as a CUDA graph without copying them in (mutated non-static inputs would make inductor
skip the graph) and the ops' in-place mutations reach the real tensors with no whole-pool copy.
"""

from __future__ import annotations

import torch

from .. import StatePool

from .step import spec_decode_step

__all__ = ["compile_step", "pool_tensors"]


def pool_tensors(pool: StatePool) -> list[torch.Tensor]:
    """Every tensor a step mutates or indexes in ``pool``: states, records, snapshot slots."""
    out = []
    for state, records in (*pool.gdn_groups.values(), *pool.conv_groups.values()):
        out.append(state)
        out.extend(records if isinstance(records, tuple) else (records,))
    out.append(pool.snapshot_slots(pool.max_tokens))
    return out


def compile_step(model, pool: StatePool, *, temperature: float = 1.0, generator: torch.Generator | None = None,
                 pad_token: int = 0, **compile_kwargs):
    """``torch.compile`` the uniform step for ``model`` and ``pool``.

    Args:
        model, pool, temperature, pad_token: as :func:`ssm_spec.graphs.step.spec_decode_step`.
        generator: must be None (``torch.compile`` cannot take a ``torch.Generator``; sampling
            uses the device's default generator).
        compile_kwargs: passed to ``torch.compile`` (``fullgraph`` defaults to True, ``dynamic``
            to False: one graph per batch size, as the captured buckets).

    Raises:
        ValueError: a ``generator``, ``temperature <= 0``, or a pool spread over several devices
            (the compiled step is one device's graph).

    Returns:
        ``step(window_tokens, window_lens, state_indices, num_computed_tokens, query_start_loc,
        draft_probs=None) -> (accepted_tokens, num_accepted_tokens)``, compiled.
    """
    if generator is not None:
        raise ValueError("compile_step: generator: torch.compile cannot trace a torch.Generator argument; "
                         "sample from the device's default generator (seed it with torch.manual_seed)")
    if not temperature > 0:
        raise ValueError(f"compile_step: temperature: got {temperature}; expected > 0")
    if pool.spread:
        raise ValueError(f"compile_step: the pool spans {', '.join(map(str, pool.devices))}; the compiled step "
                         "runs on one device (run a model spread over devices eagerly)")
    for t in pool_tensors(pool):
        torch._dynamo.mark_static_address(t)
    for t in model.buffers():
        torch._dynamo.mark_static_address(t)
    compile_kwargs.setdefault("fullgraph", True)
    compile_kwargs.setdefault("dynamic", False)

    def step(window_tokens, window_lens, state_indices, num_computed_tokens, query_start_loc, draft_probs=None):
        with torch.no_grad():  # inference only: the ops have no autograd formula
            return spec_decode_step(model, pool, window_tokens, window_lens, state_indices, num_computed_tokens,
                                    query_start_loc, draft_probs, temperature=temperature, generator=generator,
                                    pad_token=pad_token)

    return torch.compile(step, **compile_kwargs)
