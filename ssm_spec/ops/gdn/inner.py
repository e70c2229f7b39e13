"""The one inner update that GDN verify, commit and the native snapshot share, and their tiles.

Bit identity between commit and the native per-token state (DESIGN.md section 2) holds
because all three kernels build the state with *these* functions. Verify and the snapshot
(and the folded verify) must also run the same tile shape and ``num_warps``, since the order of
the K reduction that produces ``u`` depends on them; commit does no reduction (its update is
elementwise, one rounding per element), so its bits do not depend on its tile and it has its
own (a departure from DESIGN.md section 2's wording, which has all three share one; tested on
the H200 by ``tests/test_gdn_ops.py::test_commit_bits_do_not_depend_on_its_tile_on_gpu``).
Tiles are chosen only here (:func:`gdn_tile_config`).

What the H200 taught us (``scripts/diag_bitwise.py``; ``docs/perf-notes.md``): with the
key norm summed as a replicated ``[BK]`` vector, the ``k̂`` a program recorded and the one its
own update used differed in the last bit for some shapes, so commit (which follows the record
exactly) and the snapshot disagreed; :func:`l2_normalize_key` sums over the state tile
instead. As further guards the two state operations are PTX (``mul.rn.f32``,
``fma.rn.f32``), which neither LLVM nor ptxas may contract, and :func:`pin` makes the stored
``u`` the registers the update reads. ``USE_PTX`` is off under ``TRITON_INTERPRET=1`` (the
interpreter runs no PTX), where plain operations are exact.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: Epsilon of the q/k L2 normalisation (DESIGN.md section 2).
L2NORM_EPS: tl.constexpr = tl.constexpr(1e-6)


@triton.jit
def l2_normalize(x):
    """``x * rsqrt(sum(x * x) + 1e-6)`` in fp32 (DESIGN.md section 2 writes ``x / sqrt(.)``).

    One multiply per element instead of an IEEE division and square root. On CUDA ``rsqrt``
    is ``rsqrt.approx.ftz.f32`` (2 ulp), so ``k̂`` and ``q̂`` land within about 3 ulp of the
    quotient (the Triton interpreter computes an IEEE ``1/sqrt``). 17 % off verify's time on the
    H200 (B=64, k=3, fp32 state: 103.4 -> 85.7 us, a variant sweep of ``scripts/tune_gdn.py`` at
    commit 6d03fc8; docs/perf-notes.md). Bit identity is unaffected: ``k̂`` is computed once per
    token in the one binary verify and the snapshot share, recorded, and replayed by commit;
    ``q̂`` only reaches the output.
    """
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + L2NORM_EPS)


@triton.jit
def gdn_decay(b_h, b_d, USE_PTX: tl.constexpr):
    """``P = S * d`` for a ``[BK, BV]`` fp32 state tile and a scalar decay, rounded once."""
    if USE_PTX:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [b_h, tl.broadcast_to(b_d, b_h.shape)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        return b_h * b_d


@triton.jit
def l2_normalize_key(b_k, BK: tl.constexpr, BV: tl.constexpr):
    """``k * rsqrt(sum(k * k) + 1e-6)`` (as :func:`l2_normalize`) for a ``[BK]`` key, with the
    sum taken over the key broadcast to the ``[BK, BV]`` state tile (every column holds the same sum; ``max`` picks it).

    Summed as a replicated ``[BK]`` vector, the norm that reached the recorded ``k̂`` and the
    one that reached the state update differed in the last bit on the H200 for some shapes
    (K=16, 32: Triton rematerializes the chain per layout, and the replicated reduction sums
    in another order in each). The tile's own layout gives one order for every use, and costs
    less than the replicated reduction did (205 us against 213 us, verify at B=64, W=4).
    """
    b_k2 = tl.broadcast_to(b_k[:, None], (BK, BV))
    return b_k * tl.rsqrt(tl.max(tl.sum(b_k2 * b_k2, axis=0), axis=0) + L2NORM_EPS)


@triton.jit
def gdn_correction(b_p, b_k, b_v, b_beta):
    """``u = beta * (v - P^T k̂)``: ``[BV]`` from ``P [BK, BV]``, ``k̂ [BK, BV]`` (a key
    broadcast along V), ``v [BV]``."""
    return b_beta * (b_v - tl.sum(b_p * b_k, axis=0))


@triton.jit
def gdn_apply(b_p, b_k, b_u, USE_PTX: tl.constexpr):
    """``S = fma(k̂, u, P)`` elementwise: ``S[i, j] = k̂[i, j] * u[j] + P[i, j]`` (``k̂`` a key
    broadcast along V), one rounding."""
    if USE_PTX:
        return tl.inline_asm_elementwise(
            "fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r",
            [b_k, tl.broadcast_to(b_u[None, :], b_p.shape), b_p],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.fma(b_k, b_u[None, :], b_p)


@triton.jit
def load_record_token(ru_ptr, rk_ptr, rd_ptr, tok, end, i_h, i_hv, o_k, o_v, m_k, m_v,
                      s_rut, s_ruh, s_ruv, s_rkt, s_rkh, s_rkk, s_rdt, s_rdh):
    """Replay record of token ``tok`` for one program: ``k̂ [BK], u [BV], decay`` (fp32), zeros
    unless ``tok < end`` (a prefetch past the last accepted token reads nothing). Commit and
    the folded verify load the next token's record while they apply this one. The vector
    masks compare per lane: Triton 3.6's interpreter rejects a vector mask combined with a
    scalar one."""
    b_k = tl.load(rk_ptr + tok * s_rkt + i_h * s_rkh + o_k * s_rkk, mask=m_k & (o_k * 0 + tok < end), other=0)
    b_u = tl.load(ru_ptr + tok * s_rut + i_hv * s_ruh + o_v * s_ruv, mask=m_v & (o_v * 0 + tok < end), other=0)
    b_d = tl.load(rd_ptr + tok * s_rdt + i_hv * s_rdh, mask=tok < end, other=0)
    return b_k, b_u, b_d


_USE_PTX = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True") and torch.version.hip is None


def use_ptx() -> bool:
    """Whether the kernels may use PTX inline assembly: not under the Triton interpreter (which
    must be chosen before import, so this is decided once, off the launch path) nor on ROCm."""
    return _USE_PTX


@triton.jit
def pin(x, USE_PTX: tl.constexpr):
    """An opaque identity: every later use of ``x`` (the record store and the state update)
    reads these very registers (cheap for a ``[BV]`` vector; on a whole tile it cost 60 %). Without it Triton may rematerialize the producer chain of a
    value in another layout for one of its uses, and a rematerialized reduction sums in
    another order."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=False, pack=1)
    else:
        return x


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


#: ``(K, V, state dtype) -> (BV, num_warps)`` measured on the H200 by ``scripts/tune_gdn.py``
#: (B=64, k=1 and 3; runs in benchmarks/results/tune/, discussed in docs/perf-notes.md).
#: ``WINDOW_TILES`` serves verify, the snapshot and the folded verify, which must share it (their K reductions make ``u``); commit does no
#: reduction (its update is elementwise, so its bits do not depend on the tile) and has its own.
#: ``SNAPSHOT_OWN_TILES`` is the native snapshot's own fastest tile, used only by the benchmark
#: for a fair baseline (the op itself runs the window tile, for bit identity).
WINDOW_TILES: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {
    (128, 128, torch.float32): (64, 2),  # verify 85.7 us at k=3 (rsqrt sweep; BV=32, 4 warps: 166.9 before it)
    (128, 128, torch.bfloat16): (32, 1),  # verify 77.7 us
}
COMMIT_TILES: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {
    (128, 128, torch.float32): (64, 4),  # 70.5 us at k=1, 87.6 at k=3 (BV=16, 1 warp: 86.9, 86.1)
    (128, 128, torch.bfloat16): (32, 2),  # 57.1 us at k=3 (no k=1 sweep)
}
SNAPSHOT_OWN_TILES: dict[tuple[int, int, torch.dtype], tuple[int, int]] = {
    (128, 128, torch.float32): (16, 1),  # k=3, rsqrt sweep: 189.4 us (193.9 on the window tile)
    (128, 128, torch.bfloat16): (64, 2),  # k=3, rsqrt sweep: 129.6 us (137.5 on the window tile)
}


def _default_tile(K: int, V: int) -> tuple[int, int, int]:
    bk = next_power_of_2(K)
    return bk, min(next_power_of_2(V), max(8, 4096 // bk)), 4


def check_tile(config, K: int) -> tuple[int, int, int]:
    """A launcher's ``config`` override ``(BK, BV, num_warps)`` (benchmarks and tuning), checked.

    Raises:
        ValueError: not three integers, ``BK`` other than ``next_pow2(K)``, ``BV`` not a power
            of two or ``BK * BV`` above Triton's 2**20 elements per tensor, ``num_warps`` not
            in 1, 2, 4, 8, 16.
    """
    want = next_power_of_2(K)
    try:
        ok = len(config) == 3 and all(isinstance(c, int) and not isinstance(c, bool) for c in config)
    except TypeError:
        ok = False
    if ok:
        BK, BV, warps = config
        ok = (BK == want and BV >= 1 and not BV & (BV - 1) and BK * BV <= 1 << 20
              and warps in (1, 2, 4, 8, 16))
    if not ok:
        raise ValueError(f"config: expected three ints (BK = next_pow2(K) = {want}, BV a power of two with "
                         f"BK * BV <= 2**20, num_warps in 1, 2, 4, 8, 16), got {config!r}")
    return BK, BV, warps


def gdn_tile_config(K: int, V: int, kernel: str = "window",
                    state_dtype: torch.dtype = torch.float32) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)`` of a GDN kernel on a ``[K, V]`` state.

    A program holds the whole key dim (``BK = next_pow2(K)``, needed for the normalisation and
    the reduction) and a ``BV``-wide slice of the value dim. ``kernel``: ``"window"`` (verify,
    snapshot and folded verify: one tile for all three, so commit == snapshot bit for bit),
    ``"commit"``, or ``"snapshot_own"`` (the benchmark's tuned native baseline);
    ``state_dtype`` is the pool's. Shapes not in the measured tables get about 4096 state
    elements per 4-warp program.

    Raises:
        ValueError: an unknown ``kernel``, or ``K`` or ``V`` below 1.
    """
    if K < 1 or V < 1:
        raise ValueError(f"K, V: expected >= 1, got {K}, {V}")
    tables = {"window": WINDOW_TILES, "commit": COMMIT_TILES, "snapshot_own": SNAPSHOT_OWN_TILES}
    if kernel not in tables:
        raise ValueError(f"kernel: expected one of {sorted(tables)}, got {kernel!r}")
    key = (K, V, state_dtype)
    tile = tables[kernel].get(key) or (tables["window"].get(key) if kernel == "snapshot_own" else None)
    if tile is None:
        return _default_tile(K, V)
    return next_power_of_2(K), tile[0], tile[1]
