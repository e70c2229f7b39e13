"""Prefill of one row: the chunked GDN prefill (fla-core on CUDA, the reference otherwise) and
the causal conv over a prompt, split at align-mode boundaries so each boundary state is the
state after exactly that many tokens."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import reference


@functools.cache
def _fla_chunk():
    """fla-core's chunked gated delta rule, or None (not installed, or no CUDA)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # fla-core is the `cuda` extra; never installed on CPU machines
        return None
    return chunk_gated_delta_rule


def gdn_prefill_segment(q, k, v, g, beta, initial_state, scale):
    """Run the gated delta rule over one prompt segment.

    Args:
        q, k ``[L, H, K]``; v ``[L, HV, V]``; g, beta ``[L, HV]``; initial_state ``[HV, K, V]``
        fp32. Returns ``(out [L, HV, V] fp32, final_state [HV, K, V] fp32)``.

    On CUDA with fla-core installed (and head dims >= 16) this is
    ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (the chunked prefill the library relies
    on; docs/design.md section 8); otherwise the reference's per-token expressions, keeping only the
    running state.
    """
    # fla's chunked kernels tile K and V with tl.dot, which needs dims of at least 16
    chunk = _fla_chunk() if q.is_cuda and min(q.shape[-1], v.shape[-1]) >= 16 else None
    if chunk is not None:
        q, k, v, g, beta = (x.contiguous()[None] for x in (q, k, v, g, beta))
        out, final = chunk(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state[None].float(),
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out[0].float(), final[0].float()
    res = reference.gdn_native_step(q, k, v, g, beta, initial_state, scale=scale, dtype=torch.float32,
                                    keep_states=False)
    return res.out, res.states[-1]


def uses_fla(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`gdn_prefill_segment` runs fla-core's kernel for these inputs."""
    return q.is_cuda and min(q.shape[-1], v.shape[-1]) >= 16 and _fla_chunk() is not None


def gdn_prefill_rows_batched(q, k, v, g, beta, initial_states, scale):
    """The reference prefill of ``R`` rows of one length at once (``q, k [R, L, H, K]``, ``v
    [R, L, HV, V]``, ``g, beta [R, L, HV]``, ``initial_states [R, HV, K, V]``;
    :func:`ssm_spec.reference.gdn_native_step_rows`): each row gets what
    :func:`gdn_prefill_segment` gives it alone, from one token loop.

    Returns ``(out [R, L, HV, V] fp32, final_states [R, HV, K, V] fp32)``.
    """
    res = reference.gdn_native_step_rows(q, k, v, g, beta, initial_states.float(), scale=scale, dtype=torch.float32)
    return res.out, res.states


def gdn_prefill_rows(q, k, v, g, beta, initial_states, scale):
    """The prefill of ``R`` rows of one length at once, each row on its own (no varlen packing,
    no host reads: a CUDA graph holds it): ``q, k [R, L, H, K]``, ``v [R, L, HV, V]``,
    ``g, beta [R, L, HV]``, ``initial_states [R, HV, K, V]`` fp32.

    On CUDA with fla-core (head dims >= 16) one batched ``chunk_gated_delta_rule`` call (rows
    as its batch dimension); otherwise :func:`gdn_prefill_rows_batched`.

    Returns ``(out [R, L, HV, V] fp32, final_states [R, HV, K, V] fp32)``.
    """
    if uses_fla(q, v):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        out, final = _fla_chunk()(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_states.float(),
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out.float(), final.float()
    return gdn_prefill_rows_batched(q, k, v, g, beta, initial_states, scale)


def gdn_prefill_row(q, k, v, g, beta, initial_state, boundaries, scale):
    """The whole row, split at ``boundaries`` (offsets, ascending).

    Returns ``(out [L, HV, V] fp32, final_state, [state after each boundary offset])``.
    """
    L = q.shape[0]
    cuts = [0] + [off for off in boundaries if 0 < off < L] + [L]
    state = initial_state.float()
    outs, at = [], {}
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        out, state = gdn_prefill_segment(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state, scale)
        outs.append(out)
        at[hi] = state
    return torch.cat(outs), state, [at[off] for off in boundaries]


def conv_prefill_row(x, weight, bias, initial_state, dilation, activation, boundaries):
    """Causal depthwise conv over a prompt with the conv state as left context.

    Args:
        x ``[L, C]``; weight ``[C, ks]``; bias ``[C]`` or None; initial_state ``[Lc, C]``.
    Returns:
        ``(out [L, C] in x's dtype, final state [Lc, C], [state after each boundary offset])``.
    """
    lc = initial_state.shape[0]
    hist = torch.cat([initial_state.to(x.dtype), x])  # [Lc + L, C]
    y = F.conv1d(hist.T[None].float(), weight.float()[:, None, :], None if bias is None else bias.float(),
                 dilation=dilation, groups=x.shape[1])[0].T
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), hist[hist.shape[0] - lc:], [hist[off:off + lc] for off in boundaries]


def conv_prefill_rows(x, weight, bias, initial_states, dilation, activation):
    """:func:`conv_prefill_row` for ``R`` rows of one length at once (``x [R, L, C]``,
    ``initial_states [R, Lc, C]``), one batched conv. Returns ``(out [R, L, C], final [R, Lc, C])``."""
    lc = initial_states.shape[1]
    hist = torch.cat([initial_states.to(x.dtype), x], dim=1)  # [R, Lc + L, C]
    y = F.conv1d(hist.transpose(1, 2).float(), weight.float()[:, None, :], None if bias is None else bias.float(),
                 dilation=dilation, groups=x.shape[2]).transpose(1, 2)
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), hist[:, hist.shape[1] - lc:]
