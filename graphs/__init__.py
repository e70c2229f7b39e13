"""Capture of a whole spec-decode step in one CUDA graph (DESIGN.md section 6).

Here so far: the on-device acceptance rules the captured step runs between verify and commit
(:mod:`graphs.acceptance`: greedy matching and speculative rejection sampling, no host sync,
fixed shapes). The capture runner and the compiled step are the rest of the graphs issue.
"""

from .acceptance import greedy_accept, rejection_sample_accept

__all__ = ["greedy_accept", "rejection_sample_accept"]
