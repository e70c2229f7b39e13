"""The GDN kernels' tiles: the measured table :data:`TILES` and :func:`gdn_tile_config`, which
picks a launch's ``(BK, BV, num_warps)`` from it, and :func:`check_tile` for a launcher's
override. A tile changes speed, never bits (:mod:`ssm_spec.ops.gdn.inner`: every reduction has
an order of the code's)."""

from __future__ import annotations

import torch


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_k(K: int) -> int:
    """The key-axis block of every GDN kernel: ``next_pow2(K)`` (at least 2, so
    :func:`~ssm_spec.ops.gdn.inner.kdot` always has a pair to add)."""
    return max(2, next_power_of_2(K))


#: Measured tiles: ``(K, V, state dtype) -> kernel -> ((max_batch, BV, num_warps), ...)``, by
#: ascending ``max_batch``; a launch of ``B`` rows takes the first entry with ``B <= max_batch``
#: (``None``: any batch). Chosen on the H200 by ``scripts/tune_gdn.py`` (runs, times and reasoning
#: in docs/perf-notes.md, "The tile tables"). Every GDN kernel's bits are a property of its code,
#: not of its tile (:func:`~ssm_spec.ops.gdn.inner.kdot`), so verify, the folded verify, the
#: snapshot and commit each take their own fastest tile per batch size, and a request's bits do
#: not depend on the batch it runs in.
TILES: dict[tuple[int, int, torch.dtype], dict[str, tuple[tuple[int | None, int, int], ...]]] = {
    (128, 128, torch.float32): {
        "verify": ((2, 8, 1), (None, 32, 1)),
        "snapshot": ((4, 16, 1), (None, 64, 2)),
        "commit": ((None, 64, 4),),
        # one warp owns whole state rows (no cross-lane sums): measured fastest on the H200
        "closed_form": ((None, 128, 1),),
    },
    (128, 128, torch.bfloat16): {
        "verify": ((None, 32, 1),),
        "snapshot": ((None, 32, 1),),
        "commit": ((None, 32, 2),),
        "closed_form": ((None, 128, 1),),  # not swept for bf16: fp32's tile
    },
}
KERNELS = ("verify", "snapshot", "commit", "closed_form")


def _default_tile(K: int, V: int) -> tuple[int, int, int]:
    """Shapes not in :data:`TILES`: one warp holding about 4096 state elements (128 per thread,
    the measured sweet spot at Qwen3-Next widths)."""
    bk = block_k(K)
    return bk, max(1, min(next_power_of_2(V), 4096 // bk)), 1


def check_tile(config, K: int) -> tuple[int, int, int]:
    """A launcher's ``config`` override ``(BK, BV, num_warps)`` (benchmarks and tuning), checked.

    Raises:
        ValueError: not three integers, ``BK`` other than ``max(2, next_pow2(K))``, ``BV`` not a power
            of two or ``BK * BV`` above Triton's 2**20 elements per tensor, ``num_warps`` not
            in 1, 2, 4, 8, 16.
    """
    want = block_k(K)
    try:
        ok = len(config) == 3 and all(isinstance(c, int) and not isinstance(c, bool) for c in config)
    except TypeError:
        ok = False
    if ok:
        BK, BV, warps = config
        ok = (BK == want and BV >= 1 and not BV & (BV - 1) and BK * BV <= 1 << 20
              and warps in (1, 2, 4, 8, 16))
    if not ok:
        raise ValueError(f"config: expected three ints (BK = max(2, next_pow2(K)) = {want}, BV a power of two with "
                         f"BK * BV <= 2**20, num_warps in 1, 2, 4, 8, 16), got {config!r}")
    return BK, BV, warps


def gdn_tile_config(K: int, V: int, kernel: str = "verify",
                    state_dtype: torch.dtype = torch.float32, batch: int | None = None) -> tuple[int, int, int]:
    """``(BK, BV, num_warps)`` of a GDN kernel on a ``[K, V]`` state for a launch of ``batch``
    rows (``None``: a large batch).

    A program holds the whole key dim (``BK = max(2, next_pow2(K))``) and a ``BV``-wide slice of
    the value dim. ``kernel``: ``"verify"`` (verify and the folded verify), ``"snapshot"``,
    ``"commit"`` or ``"closed_form"`` (fast mode's verify and its folded form); ``state_dtype`` is the pool's. The tile changes speed only, never bits
    (:data:`TILES`). Shapes not in the measured tables: :func:`_default_tile`.

    Raises:
        ValueError: an unknown ``kernel``, or ``K`` or ``V`` below 1.
    """
    if K < 1 or V < 1:
        raise ValueError(f"K, V: expected >= 1, got {K}, {V}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {sorted(KERNELS)}, got {kernel!r}")
    entries = TILES.get((K, V, state_dtype), {}).get(kernel)
    if not entries:
        if kernel == "closed_form":  # it streams the state: one warp over whole rows (up to 128 values)
            return block_k(K), min(next_power_of_2(V), 128), 1
        return _default_tile(K, V)
    # every table ends with a ``None`` bound (tested), so a batch past every bound takes it
    _, bv, warps = next(e for e in entries if e[0] is None or (batch is not None and batch <= e[0]))
    return block_k(K), bv, warps
