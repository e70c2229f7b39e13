"""The native spec-decode GDN kernel engines ship today, as a benchmark baseline.

Written from the structure of vLLM's fused recurrent GDN with spec decoding (no code taken
from it): one program per 8-wide slice of V and per (row, value head),
one warp, all ``K`` key rows of the slice in the program. Each row reads its checkpoint from
the slot of its last accepted token (``state_indices[b, num_accepted_tokens[b] - 1]``) and,
after every window token ``t``, stores the whole state in place into that token's own slot
(``state_indices[b, t]``). Reductions are plain ``tl.sum`` (the layout's order), the
normalisation an IEEE quotient by a square root; there is no replay record, no autotuning and
no tile table: the fixed structure is the point.

Not part of the library: :mod:`bench_ops` times it beside ``snapshot`` (our tuned per-draft
kernel). ``tests/interpret`` checks it against the token-by-token reference under the Triton
interpreter, so the time is a correct kernel's.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: The engine kernel's fixed tile: 8 value columns, one warp.
BV, NUM_WARPS = 8, 1


@triton.jit
def native_engine_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, idx_ptr, n_ptr, out_ptr,
    scale, W,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_bt, s_bh,
    s_ss, s_sh, s_sk, s_sv, s_ib, s_iw, s_ot, s_oh, s_ov,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
):
    """Row ``b`` owns tokens ``[b * W, (b + 1) * W)`` (a uniform window, as the engine's
    spec-decode batch); a slot ``< 0`` is skipped (read: the whole row; write: that token)."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    tile = i_hv * s_sh + o_k[:, None] * s_sk + o_v[None, :] * s_sv
    n = tl.load(n_ptr + i_b)
    src = tl.load(idx_ptr + i_b * s_ib + (n - 1) * s_iw).to(tl.int64)
    if (n >= 1) & (src >= 0):
        b_h = tl.load(state_ptr + src * s_ss + tile, mask=m_h, other=0).to(tl.float32)
        for w in range(W):
            t = (i_b * W + w).to(tl.int64)
            b_q = tl.load(q_ptr + t * s_qt + i_h * s_qh + o_k * s_qk, mask=m_k, other=0).to(tl.float32)
            b_k = tl.load(k_ptr + t * s_kt + i_h * s_kh + o_k * s_kk, mask=m_k, other=0).to(tl.float32)
            b_v = tl.load(v_ptr + t * s_vt + i_hv * s_vh + o_v * s_vv, mask=m_v, other=0).to(tl.float32)
            b_g = tl.load(g_ptr + t * s_gt + i_hv * s_gh).to(tl.float32)
            b_beta = tl.load(beta_ptr + t * s_bt + i_hv * s_bh).to(tl.float32)
            if USE_QK_L2NORM:
                b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
                b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
            b_q = b_q * scale
            b_h *= tl.exp(b_g)
            b_v -= tl.sum(b_h * b_k[:, None], 0)
            b_v *= b_beta
            b_h += b_k[:, None] * b_v[None, :]
            b_o = tl.sum(b_h * b_q[:, None], 0)
            tl.store(out_ptr + t * s_ot + i_hv * s_oh + o_v * s_ov, b_o.to(out_ptr.dtype.element_ty), mask=m_v)
            dst = tl.load(idx_ptr + i_b * s_ib + w * s_iw).to(tl.int64)
            if dst >= 0:
                tl.store(state_ptr + dst * s_ss + tile, b_h.to(state_ptr.dtype.element_ty), mask=m_h)


def native_engine_verify(q, k, v, g, beta, state, state_indices, num_accepted_tokens, out,
                         scale, use_qk_l2norm=True) -> None:
    """Run the engine baseline over ``B = state_indices.shape[0]`` rows of ``W`` tokens.

    Args:
        q, k: ``[B * W, H, K]``; v: ``[B * W, HV, V]``; g: ``[B * W, HV]`` fp32; beta:
            ``[B * W, HV]`` (any float dtype; views fine).
        state: ``[S, HV, K, V]`` fp32 or bf16 pool, **mutated** (the W token slots of each row).
        state_indices: ``[B, W]`` int32: row ``b``'s slot for the state after window token
            ``t`` (the engine's per-draft slots); the checkpoint is read from column
            ``num_accepted_tokens[b] - 1``.
        num_accepted_tokens: ``[B]`` int32, contiguous, tokens accepted in the previous step:
            at least 1 (the engine's contract; the kernel reads the slot column ``n - 1``
            before checking ``n``, as a baseline it does no more than the engine does).
        out: ``[B * W, HV, V]`` output buffer, written.
        scale: query scale (float).
    """
    T, H, K = q.shape
    HV, V = v.shape[1:]
    B, W = state_indices.shape
    if B == 0 or W == 0:
        return
    assert T == B * W, "native_engine_verify: every row runs a window of W tokens"
    grid = (triton.cdiv(V, BV), B * HV)
    native_engine_kernel[grid](
        q, k, v, g, beta, state, state_indices, num_accepted_tokens, out, float(scale), W,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state.stride(),
        *state_indices.stride(), *out.stride(),
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, USE_QK_L2NORM=bool(use_qk_l2norm),
        num_warps=NUM_WARPS,
    )

