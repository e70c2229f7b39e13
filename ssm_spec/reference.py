"""Token-by-token ("native") reference implementations: the oracles.

Plain PyTorch, one token at a time, float64-capable. Every formula is docs/design.md section 2.
The CPU kernels of the ops (``ssm_spec/ops/*``) are built from the per-token helpers below
(:func:`gdn_token_update`, :func:`gdn_replay_update`, :func:`short_conv_token`), so on the CPU
the reference and the ops evaluate the same expressions on tensors of the same shapes, which
is what makes ``torch.equal`` between them a valid test.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "l2norm",
    "gdn_token_update",
    "gdn_replay_update",
    "gdn_native_step",
    "GDNNativeResult",
    "short_conv_token",
    "short_conv_native_step",
    "ShortConvNativeResult",
    "L2NORM_EPS",
    "gdn_native_step_rows",
]

#: epsilon inside the square root of the q/k L2 normalisation (docs/design.md section 2.1; the value
#: fla-core's ``l2norm`` and Hugging Face's Qwen3-Next ``l2norm`` use).
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x * x, -1) + eps)`` over the last dim, in ``x``'s dtype."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _compute_dtype(*tensors: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., H, K] -> [..., HV, K]: value head ``i`` uses key head ``i // (HV // H)``."""
    h = x.shape[-2]
    return x.repeat_interleave(hv // h, dim=-2) if hv != h else x


def gdn_token_update(state, khat, qhat, v, decay, beta):
    """One token of the gated delta rule for every value head.

    Args:
        state: ``[HV, K, V]`` state before the token (compute dtype).
        khat, qhat: ``[HV, K]`` normalised key / scaled normalised query, already expanded
            to value heads.
        v: ``[HV, V]``; decay ``d = exp(g)`` and beta: ``[HV]``.

    Returns:
        ``(new_state [HV, K, V], u [HV, V], o [HV, V])`` with ``P = S * d``,
        ``u = beta * (v - P^T k̂)``, ``S' = P + k̂ u^T`` (one rounding per operation; the
        Triton kernels use an explicit fma here), ``o = S'^T q̂``.
    """
    p = state * decay[:, None, None]
    u = beta[:, None] * (v - (p * khat[:, :, None]).sum(-2))
    new_state = gdn_replay_update_from_decayed(p, khat, u)
    o = (new_state * qhat[:, :, None]).sum(-2)
    return new_state, u, o


def gdn_replay_update_from_decayed(p, khat, u):
    """``S' = P + k̂ u^T`` for ``P`` [HV, K, V] (already decayed), ``k̂`` [HV, K], ``u`` [HV, V]."""
    return p + khat[:, :, None] * u[:, None, :]


def gdn_replay_update(state, khat, u, decay):
    """Replay one recorded token: ``S' = S * d + k̂ u^T`` (the commit's update).

    Shapes as in :func:`gdn_token_update`; evaluates exactly the expressions that
    :func:`gdn_token_update` used to build ``S'``, so replaying the recorded ``(u, k̂, d)``
    reproduces the verify-time state bit for bit.
    """
    return gdn_replay_update_from_decayed(state * decay[:, None, None], khat, u)


def gdn_window_inputs(name, q, k, v, g, beta, initial_state, scale, use_qk_l2norm, dtype):
    """Check one window's shapes and bring its inputs to the compute dtype: ``(cd, k̂ [T, H, K],
    q̂ * scale [T, H, K], v, g, beta, initial_state)`` (shared by :func:`gdn_native_step` and the
    closed-form oracle).

    Raises:
        ValueError: naming ``name``, on inconsistent shapes or ``HV % H != 0``.
    """
    T, H, K = q.shape
    HV, V = v.shape[-2:]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, HV) or beta.shape != (T, HV):
        raise ValueError(f"{name}: inconsistent shapes q={tuple(q.shape)} k={tuple(k.shape)} "
                         f"v={tuple(v.shape)} g={tuple(g.shape)} beta={tuple(beta.shape)}")
    if initial_state.shape != (HV, K, V) or HV % H != 0:
        raise ValueError(f"{name}: initial_state must be [HV={HV}, K={K}, V={V}] with HV % H == 0, "
                         f"got {tuple(initial_state.shape)} and H={H}")
    cd = _compute_dtype(q, k, v, g, beta, initial_state, dtype=dtype)
    scale = K**-0.5 if scale is None else scale
    qf, kf, vf, gf, bf = (x.to(cd) for x in (q, k, v, g, beta))
    khat = l2norm(kf) if use_qk_l2norm else kf
    qhat = (l2norm(qf) if use_qk_l2norm else qf) * scale
    return cd, khat, qhat, vf, gf, bf, initial_state.to(cd)


def gdn_native_step_rows(q, k, v, g, beta, initial_states, scale=None, use_qk_l2norm=True, dtype=None):
    """:func:`gdn_native_step` over ``R`` rows of one length at once, keeping final states only:
    ``q, k [R, L, H, K]``, ``v [R, L, HV, V]``, ``g, beta [R, L, HV]``, ``initial_states
    [R, HV, K, V]``. Every value head is independent, so the rows' heads are stacked into one
    sequence of ``R * H`` key heads and each row gets exactly (bit for bit) what it gets alone.

    Returns:
        :class:`GDNNativeResult` with a leading row dim: ``out, u [R, L, HV, V]``, ``khat
        [R, L, H, K]``, ``decay [R, L, HV]``, ``states [R, HV, K, V]`` (the final states).
    """
    R, L, H = q.shape[:3]
    HV = v.shape[2]

    def heads(x):  # [R, L, N, ...] -> [L, R * N, ...]
        return x.transpose(0, 1).reshape(L, R * x.shape[2], *x.shape[3:])

    res = gdn_native_step(heads(q), heads(k), heads(v), heads(g[..., None])[..., 0], heads(beta[..., None])[..., 0],
                          initial_states.reshape(R * HV, *initial_states.shape[2:]), scale=scale,
                          use_qk_l2norm=use_qk_l2norm, dtype=dtype, keep_states=False)

    def rows(x, n):  # [L, R * n, ...] -> [R, L, n, ...]
        return x.reshape(L, R, n, *x.shape[2:]).transpose(0, 1)

    final = res.states[-1] if L else initial_states.reshape(R * HV, *initial_states.shape[2:]).to(res.out.dtype)
    return GDNNativeResult(out=rows(res.out, HV), states=final.reshape(R, HV, *final.shape[1:]), u=rows(res.u, HV),
                           khat=rows(res.khat, H), decay=rows(res.decay[..., None], HV)[..., 0])


class GDNNativeResult(NamedTuple):
    """Result of :func:`gdn_native_step`, all in the compute dtype.

    ``out [T, HV, V]``, ``states [T, HV, K, V]`` (the state after each token),
    ``u [T, HV, V]``, ``khat [T, H, K]``, ``decay [T, HV]`` (the replay record).
    """

    out: torch.Tensor
    states: torch.Tensor
    u: torch.Tensor
    khat: torch.Tensor
    decay: torch.Tensor


def gdn_native_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    dtype: torch.dtype | None = None,
    keep_states: bool = True,
) -> GDNNativeResult:
    """Run the gated delta rule token by token over one sequence (docs/design.md section 2.1).

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g (log decay, ``<= 0``) and beta: ``[T, HV]``;
            any float dtype, any strides.
        initial_state: ``[HV, K, V]``, the state before the first token.
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: normalise q and k (``x / sqrt(sum(x*x) + 1e-6)``).
        dtype: compute dtype; default float64 if any input is float64, else float32.
        keep_states: ``False`` keeps only the final state (``states`` is then ``[1, HV, K, V]``,
            or empty for ``T = 0``): memory independent of ``T``, for long prompts.

    Returns:
        :class:`GDNNativeResult` with the outputs, the state after every token and the
        replay record, in the compute dtype.

    Raises:
        ValueError: on inconsistent shapes.
    """
    T, HV, K, V = q.shape[0], v.shape[-2], q.shape[-1], v.shape[-1]
    cd, khat, qhat, vf, gf, bf, s = gdn_window_inputs("gdn_native_step", q, k, v, g, beta, initial_state, scale,
                                                      use_qk_l2norm, dtype)
    decay = torch.exp(gf)
    outs, states, us = [], [], []
    for t in range(T):
        s, u, o = gdn_token_update(
            s, _expand_heads(khat[t], HV), _expand_heads(qhat[t], HV), vf[t], decay[t], bf[t]
        )
        outs.append(o)
        us.append(u)
        if keep_states or t == T - 1:
            states.append(s)
    empty_state = initial_state.new_empty((0, HV, K, V), dtype=cd)
    return GDNNativeResult(
        out=torch.stack(outs) if T else vf.new_empty((0, HV, V)),
        states=torch.stack(states) if T else empty_state,
        u=torch.stack(us) if T else vf.new_empty((0, HV, V)),
        khat=khat,
        decay=decay,
    )


def short_conv_token(window: torch.Tensor, weight: torch.Tensor, bias, activation: str):
    """One output of the causal depthwise conv.

    Args:
        window: ``[kernel_size, C]``, the inputs ``x_{t-(ks-1)D}, ..., x_{t-D}, x_t`` (oldest
            first), compute dtype.
        weight: ``[C, kernel_size]``; bias: ``[C]`` or None.
        activation: ``"silu"`` or ``"none"``.

    Returns:
        ``[C]``: ``act(bias + sum_j w[:, j] * window[j])``, summed in order ``j = 0..ks-1``.
    """
    acc = bias.clone() if bias is not None else torch.zeros_like(window[0])
    for j in range(weight.shape[1]):
        acc = acc + weight[:, j] * window[j]
    if activation == "silu":
        acc = acc * torch.sigmoid(acc)
    return acc


class ShortConvNativeResult(NamedTuple):
    """Result of :func:`short_conv_native_step`: ``out [T, C]`` and ``states [T, Lc, C]``
    (the last ``Lc`` inputs after each token, oldest first), in the compute dtype."""

    out: torch.Tensor
    states: torch.Tensor


def short_conv_native_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    dilation: int = 1,
    activation: str = "silu",
    dtype: torch.dtype | None = None,
) -> ShortConvNativeResult:
    """Run the (dilated) causal short conv token by token over one sequence.

    ``y_t[c] = act(bias[c] + sum_j w[c, j] * x_{t-(ks-1-j)*D}[c])`` (docs/design.md section 2.2;
    PyTorch's ``conv1d`` convention with left padding); inputs before the window come from
    ``conv_state``, which holds the last ``Lc = (ks - 1) * D`` inputs, oldest first.

    Args:
        x: ``[T, C]``; weight ``[C, ks]``; bias ``[C]`` or None; conv_state ``[Lc, C]``.
        dilation: ``D >= 1``. activation: ``"silu"`` or ``"none"``.
        dtype: compute dtype; default float64 if any input is float64, else float32.

    Raises:
        ValueError: on inconsistent shapes or an unknown activation.
    """
    T, C = x.shape
    ks = weight.shape[1]
    lc = (ks - 1) * dilation
    if weight.shape[0] != C or conv_state.shape != (lc, C) or dilation < 1:
        raise ValueError(
            f"short_conv_native_step: x={tuple(x.shape)} weight={tuple(weight.shape)} "
            f"conv_state={tuple(conv_state.shape)} dilation={dilation}: expected conv_state "
            f"[(kernel_size-1)*dilation={lc}, C={C}]"
        )
    if activation not in ("silu", "none"):
        raise ValueError(f"activation must be 'silu' or 'none', got {activation!r}")
    cd = _compute_dtype(x, weight, conv_state, dtype=dtype)
    hist = torch.cat([conv_state.to(cd), x.to(cd)], 0)  # [Lc + T, C]
    w = weight.to(cd)
    b = bias.to(cd) if bias is not None else None
    outs, states = [], []
    for t in range(T):
        pos = lc + t
        taps = torch.stack([hist[pos - (ks - 1 - j) * dilation] for j in range(ks)])
        outs.append(short_conv_token(taps, w, b, activation))
        states.append(hist[t + 1 : t + 1 + lc])
    return ShortConvNativeResult(
        out=torch.stack(outs) if T else hist.new_empty((0, C)),
        states=torch.stack(states) if T else hist.new_empty((0, lc, C)),
    )
