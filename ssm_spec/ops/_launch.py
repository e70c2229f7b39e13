"""Keyword arguments for kernel launches."""

from __future__ import annotations

import torch

__all__ = ["strides"]


def strides(t: torch.Tensor, *names: str) -> dict[str, int]:
    """``{name: stride}`` for the dims of ``t`` in order, one name per dim, as keyword
    arguments of a Triton launch: ``strides(q, "s_qt", "s_qh", "s_qk")``.

    Raises:
        ValueError: not one name per dim of ``t``.
    """
    if len(names) != t.dim():
        raise ValueError(f"strides: got {len(names)} names {names} for a {t.dim()}-d tensor")
    return dict(zip(names, t.stride()))


def commit_metadata_strides(query_start_loc, src_indices, num_accepted_tokens, dst_indices, boundary_indices,
                            boundary_offsets) -> dict[str, int]:
    """The stride arguments of a commit's metadata, by the names both commit kernels give them."""
    return dict(s_qsl=query_start_loc.stride(0), s_src=src_indices.stride(0), s_n=num_accepted_tokens.stride(0),
                s_dst=dst_indices.stride(0), **strides(boundary_indices, "s_bib", "s_bij"),
                **strides(boundary_offsets, "s_bob", "s_boj"))
