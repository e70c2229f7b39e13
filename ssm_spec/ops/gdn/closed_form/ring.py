"""The lazy commit's record ring: :class:`RecordRing` and the positions a slot needs."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RecordRing(NamedTuple):
    """Per-slot replay records of the lazy commit (docs/design.md section 2.6), fp32.

    Attributes:
        u: ``[S, R, HV, V]`` corrections. k: ``[S, R, H, K]`` normalised keys.
        g: ``[S, R, HV]`` log decays (``exp`` of them is the record's decay).
    """

    u: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, positions: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
              head_v_dim: int, device=None) -> RecordRing:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros((num_slots, positions, num_v_heads, head_v_dim), **f32),
                   torch.zeros((num_slots, positions, num_k_heads, head_k_dim), **f32),
                   torch.zeros((num_slots, positions, num_v_heads), **f32))


def ring_positions(max_pending: int, max_window: int) -> int:
    """Ring positions a slot needs: ``max(max_pending, max_window) + max_window`` (at least 1).

    A row's pending tokens never pass ``max(max_pending, W)`` (a row under the bound keeps at
    most ``max_pending``; a row that folds keeps only its new accepted tokens), and the window's
    records go right after them, never over a pending record another program may still read."""
    return max(1, max(max_pending, max_window) + max_window)
