"""Closed-form ("chunked") GDN window: the oracle twin of the fast mode's verify.

The exact token loop (:func:`ssm_spec.reference.gdn_native_step`) carries the state through
every window token. The same window can be solved from the checkpoint ``S0`` alone. With
cumulative log decays ``G_t = g_1 + ... + g_t`` (so ``d_t = exp(g_t)``) and normalised keys
and queries, unrolling ``S_t = d_t S_{t-1} + k̂_t u_t^T`` gives

* ``u_t = beta_t (v_t - exp(G_t) S0^T k̂_t - sum_{j<t} exp(G_t - G_j) (k̂_j . k̂_t) u_j)``: the
  corrections solve the unit lower-triangular ``W x W`` system ``(I + A) U = diag(beta) (V -
  diag(exp(G)) K S0)`` with ``A_tj = beta_t exp(G_t - G_j) (k̂_t . k̂_j)`` for ``j < t``,
  solved here by forward substitution;
* ``o_t = exp(G_t) S0^T q̂_t + sum_{j<=t} exp(G_t - G_j) (k̂_j . q̂_t) u_j``.

A pending history (the lazy commit: ``P`` accepted tokens whose records ``(u_j, k̂_j, g_j)`` are
known but not yet written into ``S0``) is the same sum over a longer sequence: the window's
tokens follow the history's, the cumulative decays run over both, and the history's ``u_j``
are given rather than solved.

The state enters only through ``K S0`` and ``Q S0`` (one ``[2W, K] x [K, V]`` product per value
head). Decays are always ``exp`` of a *difference* of cumulative log decays (at most 1 in the
causal region), never ``exp(G_t) * exp(-G_j)``, which overflows to ``0 * inf`` on strongly gated
windows (a bug FlashInfer fixed in its WY verify: flashinfer-ai/flashinfer PR #3720, which
computes ``exp(G_r - G_c)`` since). The result is mathematically the token loop's, not bit-identical to it (other
roundings); its replay record ``(u, k̂, d)`` has the token loop's layout, so commit replays it.
"""

from __future__ import annotations

import torch

from .reference import GDNNativeResult, _expand_heads, gdn_window_inputs

__all__ = ["gdn_closed_form_step"]


def gdn_closed_form_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    dtype: torch.dtype | None = None,
    history: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> GDNNativeResult:
    """Solve one window of ``T`` tokens in closed form from ``initial_state`` (module docstring).

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g (log decay, ``<= 0``) and beta: ``[T, HV]``;
            any float dtype, any strides; ``HV % H == 0``.
        initial_state: ``[HV, K, V]``, the checkpoint (read once).
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: normalise q and k (``x / sqrt(sum(x*x) + 1e-6)``).
        dtype: compute dtype; default float64 if any input is float64, else float32.
        history: the pending tokens between ``initial_state`` and the window, oldest first:
            ``(u [P, HV, V], k̂ [P, H, K], g [P, HV])`` (the lazy commit's record ring: the
            normalised keys and the log decays, not ``exp(g)``); ``None``: no history.

    Returns:
        :class:`~ssm_spec.reference.GDNNativeResult` with ``out [T, HV, V]``, the replay record
        ``u [T, HV, V]``, ``khat [T, H, K]``, ``decay [T, HV]`` and ``states [1, HV, K, V]``, the
        state after the window rebuilt as ``exp(G_T) S0 + sum_j exp(G_T - G_j) k̂_j u_j^T``
        (empty for ``T = 0``); with a history, the state after history and window.

    Raises:
        ValueError: on inconsistent shapes.
    """
    T, HV, K, V = q.shape[0], v.shape[-2], q.shape[-1], v.shape[-1]
    cd, khat, qhat, vf, gf, bf, s0 = gdn_window_inputs("gdn_closed_form_step", q, k, v, g, beta, initial_state,
                                                       scale, use_qk_l2norm, dtype)
    if history is None:
        hu, hk, hg = vf.new_empty((0, HV, V)), khat.new_empty((0, khat.shape[1], K)), gf.new_empty((0, HV))
    else:
        hu, hk, hg = (x.to(cd) for x in history)
        if hu.shape[1:] != (HV, V) or hk.shape[1:] != khat.shape[1:] or hg.shape[1:] != (HV,) or \
                not hu.shape[0] == hk.shape[0] == hg.shape[0]:
            raise ValueError(f"gdn_closed_form_step: history shapes u={tuple(hu.shape)} k={tuple(hk.shape)} "
                             f"g={tuple(hg.shape)} do not fit the window's heads")
    P = hu.shape[0]
    if T == 0:
        empty = vf.new_empty((0, HV, V))
        return GDNNativeResult(empty, s0.new_empty((0, HV, K, V)), empty, khat, torch.exp(gf))
    # the whole sequence: history tokens (u known) then window tokens (u solved)
    kh = _expand_heads(torch.cat([hk, khat]), HV).transpose(0, 1)  # [HV, P + T, K]
    qh = _expand_heads(qhat, HV).transpose(0, 1)  # [HV, T, K]
    G = torch.cumsum(torch.cat([hg, gf]), 0).transpose(0, 1)  # [HV, P + T]
    N = P + T
    causal = torch.ones(N, N, dtype=torch.bool, device=G.device).tril()
    # exp(G_i - G_j) on and below the diagonal only (a difference, <= 1 there; zero above)
    ratio = torch.where(causal, torch.exp((G[:, :, None] - G[:, None, :]).masked_fill(~causal, 0)), 0)
    ks0 = kh[:, P:] @ s0  # [HV, T, V]: the state read once, against the stacked keys ...
    qs0 = qh @ s0  # ... and queries
    rhs = bf.transpose(0, 1)[:, :, None] * (vf.transpose(0, 1) - torch.exp(G[:, P:])[:, :, None] * ks0)
    a = bf.transpose(0, 1)[:, :, None] * ratio[:, P:] * (kh[:, P:] @ kh.transpose(1, 2))  # [HV, T, N], j < i used
    u = torch.cat([hu.transpose(0, 1), torch.empty_like(rhs)], 1)  # [HV, N, V]
    for t in range(P, N):  # forward substitution of (I + A) U = rhs over the window's rows
        u[:, t] = rhs[:, t - P] - (a[:, t - P, :t, None] * u[:, :t]).sum(1)
    out = torch.exp(G[:, P:])[:, :, None] * qs0 + (ratio[:, P:] * (qh @ kh.transpose(1, 2))) @ u
    last = ratio[:, -1, :, None, None] * kh[:, :, :, None] * u[:, :, None, :]  # [HV, N, K, V]
    final = torch.exp(G[:, -1])[:, None, None] * s0 + last.sum(1)
    return GDNNativeResult(out=out.transpose(0, 1), states=final[None], u=u[:, P:].transpose(0, 1), khat=khat,
                           decay=torch.exp(gf))
