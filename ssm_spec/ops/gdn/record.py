"""The replay record: what verify writes per token and commit replays."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ReplayRecord(NamedTuple):
    """The fp32 per-token record verify writes and commit replays (docs/design.md section 1.3).

    Attributes:
        u: ``[T, HV, V]`` (or ``[NL, T, HV, V]`` grouped) float32, the correction
            ``u_t = beta_t * (v_t - P^T k̂_t)``.
        k: ``[T, H, K]`` (``[NL, T, H, K]``) float32, the normalised key ``k̂_t``.
        decay: ``[T, HV]`` (``[NL, T, HV]``) float32, ``d_t = exp(g_t)``.
    """

    u: torch.Tensor
    k: torch.Tensor
    decay: torch.Tensor

    @classmethod
    def empty(cls, q: torch.Tensor, v: torch.Tensor) -> ReplayRecord:
        """An uninitialised fp32 record for the ``T`` tokens of ``q [T, H, K]``, ``v [T, HV, V]``."""
        (T, H, K), (HV, V) = q.shape, v.shape[-2:]
        f32 = dict(dtype=torch.float32, device=v.device)
        return cls(torch.empty((T, HV, V), **f32), torch.empty((T, H, K), **f32), torch.empty((T, HV), **f32))
