"""Window and count clamping shared by every kernel (Triton) and CPU twin (Python).

Memory safety (docs/design.md section 3.4): whatever the metadata, a window is clamped into
``[0, T)`` and an accepted count into ``[0, window length]``, so no kernel indexes outside its
buffers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_window(qsl_ptr, i_b, s_qsl, T):
    """``(bos, eos)`` of row ``i_b``, clamped so that ``0 <= bos <= eos <= T``."""
    bos = tl.load(qsl_ptr + i_b * s_qsl)
    eos = tl.load(qsl_ptr + (i_b + 1) * s_qsl)
    bos = tl.minimum(tl.maximum(bos, 0), T)
    eos = tl.minimum(tl.maximum(eos, bos), T)
    return bos, eos


@triton.jit
def load_count(n_ptr, i_b, s_n, length):
    """Row ``i_b``'s accepted count, clamped into ``[0, length]``."""
    return tl.minimum(tl.maximum(tl.load(n_ptr + i_b * s_n), 0), length)


def clamped_window(qsl: list[int], b: int, num_tokens: int) -> tuple[int, int]:
    """Host twin of :func:`load_window` on a ``query_start_loc`` list."""
    bos = min(max(qsl[b], 0), num_tokens)
    return bos, min(max(qsl[b + 1], bos), num_tokens)


def clamped_count(n: int, bos: int, eos: int) -> int:
    """Host twin of :func:`load_count`."""
    return min(max(n, 0), eos - bos)
