"""Capture of a whole spec-decode step in one CUDA graph, and its ``torch.compile`` form
(docs/design.md section 6).

The source is the repository's top-level ``graphs/`` folder; ``pyproject.toml`` installs it as
``ssm_spec.graphs``, the only name to import it by (``from ssm_spec.graphs import ...``). Its
modules import each other and the rest of the library relatively (``from .. import StatePool``),
so a stray ``import graphs`` from the repository root fails instead of loading a second copy.

* :class:`SpecDecodeGraphRunner`: one CUDA graph per batch-size bucket holding verify for
  every layer, on-device acceptance and the grouped commit; static buffers, padding rows,
  one shared graph memory pool.
* :func:`spec_decode_step`: the step body (what is captured), usable eagerly.
* :func:`compile_step`: ``torch.compile(step, fullgraph=True)``, ``mode="reduce-overhead"``
  with the pool as static addresses.
* :func:`greedy_accept`, :func:`rejection_sample_accept`: the acceptance rules.
* :mod:`ssm_spec.graphs.stack`: a Qwen3-Next-shaped decoder stack with static KV buffers (harness for
  tests, examples and benchmarks).
"""

from .acceptance import greedy_accept, rejection_sample_accept
from .compiled import compile_step
from .runner import DEFAULT_BUCKETS, CaptureError, SpecDecodeGraphRunner
from .step import spec_decode_step

__all__ = ["greedy_accept", "rejection_sample_accept", "spec_decode_step", "SpecDecodeGraphRunner",
           "CaptureError", "DEFAULT_BUCKETS", "compile_step"]
