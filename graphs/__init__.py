"""Capture of a whole spec-decode step in one CUDA graph (DESIGN.md section 6).

The capture runner arrives with the modules and the step (issue "graphs/"); this package
exists now so the distribution's import packages are fixed from the start.
"""

__all__: list[str] = []
