"""GDN verify / commit / snapshot against the token-by-token reference (CPU and CUDA)."""

import pytest
import torch

from ssm_spec import ops, reference
from tests.helpers import (
    gdn_inputs,
    i32,
    native_states,
    qsl_from_lengths,
    random_pool,
    rel_err,
    rotating_counts,
    same_bits,
)

# value heads, key heads, K, V: GQA 2:1 with powers of two; 3:1 with K, V not powers of two
SHAPES = [(4, 2, 16, 32), (3, 1, 24, 20)]


def _setup(device, shape, lengths, srcs, S=10, act_dtype=torch.float32, state_dtype=torch.float32,
           seed=0, **kw):
    HV, H, K, V = shape
    gen = torch.Generator().manual_seed(seed)
    qsl = qsl_from_lengths(lengths, device)
    T = int(qsl[-1]) + 2  # two trailing token rows outside every window
    inp = gdn_inputs(T, H, HV, K, V, device, dtype=act_dtype, gen=gen, **kw)
    pool = random_pool(S, HV, K, V, device, dtype=state_dtype, gen=gen)
    return inp, pool, qsl, i32(srcs, device)


def _ref(inp, pool, qsl, b, src, dtype=torch.float64):
    bos, eos = int(qsl[b]), int(qsl[b + 1])
    return reference.gdn_native_step(*inp.window(bos, eos), pool[src], dtype=dtype)


# ----------------------------------------------------------------------------- verify


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_matches_reference(device, shape, act_dtype, state_dtype):
    # ragged windows (one empty), a padding row, slot 0 used by a real row
    lengths, srcs = [3, 0, 4, 2, 1], [0, 5, -1, 7, 2]
    inp, pool, qsl, src = _setup(device, shape, lengths, srcs, act_dtype=act_dtype,
                                 state_dtype=state_dtype)
    pool_before = pool.clone()
    out, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    assert torch.equal(pool, pool_before), "verify wrote the pool"
    tol = 1e-5 if act_dtype == torch.float32 else 1e-2
    for b, s in enumerate(srcs):
        bos, eos = int(qsl[b]), int(qsl[b + 1])
        if s < 0 or bos == eos:
            continue
        ref = _ref(inp, pool, qsl, b, s)
        assert rel_err(out[bos:eos], ref.out) < tol
        assert rel_err(rec.u[bos:eos], ref.u) < 1e-5
        assert rel_err(rec.k[bos:eos], ref.khat) < 1e-5
        assert rel_err(rec.decay[bos:eos], ref.decay) < 1e-6
        if device.type == "cpu":  # the CPU kernel evaluates the reference's expressions
            ref32 = _ref(inp, pool, qsl, b, s, dtype=torch.float32)
            assert torch.equal(rec.u[bos:eos], ref32.u)
            assert torch.equal(out[bos:eos], ref32.out.to(out.dtype))


def test_verify_leaves_padding_and_outside_tokens_untouched(device):
    lengths, srcs = [2, 3, 2], [-1, 4, -3]
    inp, pool, qsl, src = _setup(device, SHAPES[0], lengths, srcs)
    T, HV, V = inp.v.shape
    H, K = inp.q.shape[1:]
    out = torch.full((T, HV, V), float("nan"), device=device)
    ru, rk, rd = (torch.full(s, float("nan"), device=device) for s in ((T, HV, V), (T, H, K), (T, HV)))
    torch.ops.ssm_spec.gdn_verify(*inp.args(), pool, src, qsl, out, ru, rk, rd, K**-0.5, True)
    live = torch.zeros(T, dtype=torch.bool)
    live[2:5] = True
    for buf in (out, ru, rk, rd):
        assert not buf[live].isnan().any(), "a live token was not written"
        assert buf[~live].isnan().all(), "a padding or outside token was written"


def test_verify_noncontiguous_indices_and_no_l2norm(device):
    lengths, srcs = [3, 2], [6, 1]
    inp, pool, qsl, _ = _setup(device, SHAPES[0], lengths, srcs, strided=True)
    table = i32([[6, 0], [1, 0]], device)  # slots as a strided column of a 2-D table
    src = table[:, 0]
    qsl_strided = torch.stack([qsl, qsl], 1)[:, 0]
    assert not src.is_contiguous() and not qsl_strided.is_contiguous()
    out, rec = ops.gdn_verify(*inp.args(), pool, src, qsl_strided, scale=0.3, use_qk_l2norm=False)
    for b, s in enumerate(srcs):
        bos, eos = int(qsl[b]), int(qsl[b + 1])
        ref = reference.gdn_native_step(*inp.window(bos, eos), pool[s], scale=0.3,
                                        use_qk_l2norm=False, dtype=torch.float64)
        assert rel_err(out[bos:eos], ref.out) < 1e-5
        assert rel_err(rec.k[bos:eos], ref.khat) < 1e-6


# ----------------------------------------------------------------------------- commit


@pytest.mark.parametrize("shape", SHAPES + [(32, 16, 128, 128)])  # + Qwen3-Next widths
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_commit_every_count_is_the_native_state(device, shape, state_dtype):
    W = 4
    lengths, srcs = [W, W, 3, W, 0], [0, 3, 5, -1, 6]
    inp, pool, qsl, src = _setup(device, shape, lengths, srcs, state_dtype=state_dtype, seed=3,
                                 act_dtype=torch.bfloat16 if shape[2] == 128 else torch.float32)
    out, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    _, snaps = native_states(inp, pool, src, qsl)
    for trial in range(W + 1):
        counts = rotating_counts(trial, lengths, W)
        work = pool.clone()
        ops.gdn_commit(work, rec, qsl, src, i32(counts, device))
        for b, s in enumerate(srcs):
            if s < 0:
                continue
            n = counts[b]
            if n == 0:
                assert torch.equal(work[s], pool[s]), "n = 0 wrote the slot"
                continue
            native = snaps[int(qsl[b]) + n - 1]
            assert torch.equal(work[s], native), f"row {b}, n={n}: commit != native state"
            ref = _ref(inp, pool, qsl, b, s).states[n - 1]
            if state_dtype == torch.float32:
                assert rel_err(work[s], ref) < 1e-5
        untouched = [i for i in range(pool.shape[0]) if i not in srcs]
        assert torch.equal(work[untouched], pool[untouched]), "commit wrote a slot it does not own"


def test_cpu_snapshot_equals_reference_bitwise():
    lengths, srcs = [4, 2], [1, 0]
    inp, pool, qsl, src = _setup(torch.device("cpu"), SHAPES[1], lengths, srcs)
    _, snaps = native_states(inp, pool, src, qsl)
    for b, s in enumerate(srcs):
        bos, eos = int(qsl[b]), int(qsl[b + 1])
        ref = reference.gdn_native_step(*inp.window(bos, eos), pool[s], dtype=torch.float32)
        assert torch.equal(snaps[bos:eos], ref.states)


def test_commit_dst_boundaries_and_poison(device):
    W = 5
    lengths, srcs = [W, W, W], [2, 0, 9]
    S = 40
    inp, pool, qsl, src = _setup(device, SHAPES[0], lengths, srcs, S=S, seed=5)
    pool[11:] = float("nan")  # destinations, boundaries and bystanders start poisoned
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    _, snaps = native_states(inp, pool, src, qsl)
    counts = [3, W, 0]
    dst = [11, 12, 13]
    # boundary entries at every offset 0..W+1 (0, W+1 and those past n are skipped) and a null one
    offsets = [[0, 1, 3, 4, W + 1], [2, W, 1, 6, 0], [1, 2, 3, 4, 5]]
    bidx = [[14 + 5 * b + j for j in range(5)] for b in range(3)]
    bidx[1][2] = -1
    work = pool.clone()
    ops.gdn_commit(work, rec, qsl, src, i32(counts, device), i32(dst, device),
                   i32(bidx, device), i32(offsets, device))
    written = set()
    for b in range(3):
        n, base = counts[b], int(qsl[b])
        if n > 0:
            assert torch.equal(work[dst[b]], snaps[base + n - 1])
            written.add(dst[b])
        for j, off in enumerate(offsets[b]):
            if bidx[b][j] >= 0 and 1 <= off <= n:
                assert torch.equal(work[bidx[b][j]], snaps[base + off - 1]), (b, j, off)
                written.add(bidx[b][j])
    assert written == {11, 12, 15, 16, 19, 20}
    for slot in range(S):
        if slot not in written:
            assert same_bits(work[slot], pool[slot]), f"slot {slot} changed"


def test_grouped_commit_equals_per_layer(device):
    NL, W = 3, 4
    lengths, srcs = [W, 2, W], [1, 4, 0]
    counts = i32([2, 2, W], device)
    dst = i32([5, 6, 7], device)
    pools, recs = [], []
    for layer in range(NL):
        inp, pool, qsl, src = _setup(device, SHAPES[0], lengths, srcs, S=16, seed=10 + layer)
        _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
        pools.append(pool)
        recs.append(rec)
    bidx, boff = i32([[8, 9], [-1, 10], [11, 12]], device), i32([[1, 2], [1, 1], [3, 4]], device)
    grouped = torch.stack(pools)
    record = ops.ReplayRecord(*(torch.stack(x) for x in zip(*recs)))
    ops.gdn_commit(grouped, record, qsl, src, counts, dst, bidx, boff)
    for layer in range(NL):
        single = pools[layer].clone()
        ops.gdn_commit(single, recs[layer], qsl, src, counts, dst, bidx, boff)
        assert torch.equal(grouped[layer], single)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("g_fill,beta_fill", [(0.0, None), (-60.0, None), (None, 0.0), (None, 1.0), (0.0, 1.0)])
def test_extreme_gates(device, seed, g_fill, beta_fill):
    W = 4
    lengths, srcs = [W, W], [0, 3]
    inp, pool, qsl, src = _setup(device, SHAPES[0], lengths, srcs, seed=seed, g_fill=g_fill,
                                 beta_fill=beta_fill)
    out, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    _, snaps = native_states(inp, pool, src, qsl)
    work = pool.clone()
    ops.gdn_commit(work, rec, qsl, src, i32([W, 2], device))
    assert torch.equal(work[0], snaps[W - 1]) and torch.equal(work[3], snaps[W + 1])
    for b, s in enumerate(srcs):
        ref = _ref(inp, pool, qsl, b, s)
        assert torch.isfinite(out[: int(qsl[-1])]).all()
        assert rel_err(out[int(qsl[b]):int(qsl[b + 1])], ref.out) < 1e-5
        n = W if b == 0 else 2
        assert rel_err(work[s], ref.states[n - 1]) < 1e-5
        if beta_fill == 0.0 and g_fill is None:  # beta = 0: pure decay of the checkpoint
            assert rel_err(work[s], pool[s].double() * ref.decay[:n].prod(0)[:, None, None]) < 1e-5


def test_bf16_state_within_one_ulp(device):
    W = 4
    lengths, srcs = [W, W, W], [0, 1, 2]
    inp, pool32, qsl, src = _setup(device, SHAPES[0], lengths, srcs, seed=7)
    pool16 = pool32.to(torch.bfloat16)
    _, rec = ops.gdn_verify(*inp.args(), pool16, src, qsl)
    work = pool16.clone()
    ops.gdn_commit(work, rec, qsl, src, i32([W, 2, 1], device))
    _, snaps = native_states(inp, pool16, src, qsl)
    for b, (s, n) in enumerate(zip(srcs, [W, 2, 1])):
        # the fp32 reference from the same (bf16) checkpoint
        ref = reference.gdn_native_step(*inp.window(int(qsl[b]), int(qsl[b + 1])), pool16[s],
                                        dtype=torch.float64).states[n - 1]
        got = work[s].double()
        # one bf16 ulp of the value: 2^(floor(log2|x|) - 7)
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
        assert ((got - ref).abs() <= ulp).all(), "commit is more than one bf16 ulp from the reference"
        native_err = (snaps[int(qsl[b]) + n - 1].double() - ref).abs()
        assert ((got - ref).abs() <= native_err + 1e-30).all(), "commit is further than the native path"


def test_zero_length_and_empty_batch(device):
    inp, pool, qsl, src = _setup(device, SHAPES[0], [0, 0], [1, 2])
    before = pool.clone()
    out, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    ops.gdn_commit(pool, rec, qsl, src, i32([0, 0], device))
    assert torch.equal(pool, before)
    empty_qsl, empty_idx = i32([0], device), i32([], device)
    ops.gdn_verify(*inp.args(), pool, empty_idx, empty_qsl)
    ops.gdn_commit(pool, rec, empty_qsl, empty_idx, empty_idx)
    assert torch.equal(pool, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_commit_is_deterministic_on_gpu():
    device = torch.device("cuda")
    W = 4
    lengths = [W] * 64
    srcs = list(range(64))
    inp, pool, qsl, src = _setup(device, (32, 16, 128, 128), lengths, srcs, S=64)
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    counts = i32([b % (W + 1) for b in range(64)], device)
    first = None
    for _ in range(20):
        work = pool.clone()
        ops.gdn_commit(work, rec, qsl, src, counts)
        if first is None:
            first = work
        assert torch.equal(work, first)


def test_commit_noncontiguous_metadata(device):
    W = 4
    lengths, srcs = [W, 3], [2, 5]
    inp, pool, qsl, src = _setup(device, SHAPES[0], lengths, srcs, S=12)
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    meta = i32([[2, 3, 9, 10, 1], [5, 2, 11, -1, 2]], device)  # src, n, dst, boundary, offset
    got = pool.clone()
    ops.gdn_commit(got, rec, torch.stack([qsl, qsl], 1)[:, 1], meta[:, 0], meta[:, 1], meta[:, 2],
                   meta[:, 3:4], meta[:, 4:5])
    want = pool.clone()
    ops.gdn_commit(want, rec, qsl, src, i32([3, 2], device), i32([9, 11], device),
                   i32([[10], [-1]], device), i32([[1], [2]], device))
    assert torch.equal(got, want)
    assert not torch.equal(want[9], pool[9])  # something was committed


def test_tile_tables():
    """The measured tile tables: an entry per kernel and batch bucket (the first whose bound
    covers the batch; past every bound, the last), a large batch when none is given; other
    shapes get the default rule; an unknown kernel name raises."""
    from ssm_spec.ops.gdn.inner import KERNELS, TILES, gdn_tile_config

    for (K, V, dtype), kernels in TILES.items():
        assert set(kernels) == set(KERNELS)
        for kernel, entries in kernels.items():
            bounds = [b for b, _, _ in entries]
            assert bounds[-1] is None and all(x < y for x, y in zip(bounds[:-2], bounds[1:-1]))
            for max_batch, bv, warps in entries:
                for batch in ([1, max_batch] if max_batch is not None else [None, 10**6]):
                    got = gdn_tile_config(K, V, kernel, dtype, batch)
                    first = next(e for e in entries if e[0] is None or (batch is not None and batch <= e[0]))
                    assert got == (K, first[1], first[2])
    fp32 = TILES[(128, 128, torch.float32)]["verify"]
    assert gdn_tile_config(128, 128, "verify", torch.float32) == (128, *fp32[-1][1:])
    assert gdn_tile_config(24, 20) == gdn_tile_config(24, 20, "commit", batch=3) == (32, 32, 1)  # the rule
    with pytest.raises(ValueError, match="kernel"):
        gdn_tile_config(128, 128, "window")
    with pytest.raises(ValueError, match="K, V"):
        gdn_tile_config(0, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bits_do_not_depend_on_the_tile_on_gpu(state_dtype):
    """Every output, record and state is a property of the code, not of the tile: verify, the
    snapshot and commit (every count) on six tiles at Qwen3-Next widths, ragged windows and a
    padding row, bit-identical to the first tile's; commit lands on the snapshot's states."""
    from ssm_spec.ops.gdn.commit import launch_gdn_commit
    from ssm_spec.ops.gdn.verify import launch_gdn_window

    device, W = torch.device("cuda"), 4
    lengths, srcs = [W, 2, W, 3], [0, 3, -1, 5]
    inp, pool, qsl, src = _setup(device, (32, 16, 128, 128), lengths, srcs, state_dtype=state_dtype, seed=9,
                                 act_dtype=torch.bfloat16)
    T, S = inp.q.shape[0], pool.shape[0]
    scratch = torch.cat([pool, torch.full((T, *pool.shape[1:]), float("nan"), device=device).to(state_dtype)])
    snap_idx = torch.arange(S, S + T, dtype=torch.int32, device=device)
    no_bnd = torch.empty(len(srcs), 0, dtype=torch.int32, device=device)
    first = None
    for tile in [(128, 8, 1), (128, 16, 1), (128, 32, 1), (128, 32, 2), (128, 64, 2), (128, 128, 4)]:
        out = torch.full((T, 32, 128), float("nan"), device=device, dtype=torch.bfloat16)
        rec = (torch.full((T, 32, 128), float("nan"), device=device), torch.full((T, 16, 128), float("nan"),
               device=device), torch.full((T, 32), float("nan"), device=device))
        launch_gdn_window(*inp.args(), pool, src, qsl, None, out, rec, 128**-0.5, True, config=tile)
        snaps, snap_out = scratch.clone(), out.clone()
        launch_gdn_window(*inp.args(), snaps, src, qsl, snap_idx, snap_out, None, 128**-0.5, True, config=tile)
        commits = []
        for n in range(W + 1):
            work = pool.clone()
            counts = i32([min(n, L) for L in lengths], device)
            launch_gdn_commit(work, *rec, qsl, src, counts, src, no_bnd, no_bnd, config=tile)
            for b, s in enumerate(srcs):
                if s >= 0:
                    c = int(counts[b])
                    want = snaps[S + int(qsl[b]) + c - 1] if c else pool[s]
                    assert torch.equal(work[s], want), (tile, n, b)
            commits.append(work)
        bits = (out, *rec, snaps, snap_out, *commits)
        if first is None:
            first = bits
        else:
            for got, want in zip(bits, first):
                assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), tile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_commit_bits_do_not_depend_on_its_tile_on_gpu(state_dtype):
    """Any commit tile lands on the snapshot's state (on its own table's tile) bit for bit, at
    Qwen3-Next widths, every count."""
    from ssm_spec.ops.gdn.commit import launch_gdn_commit
    from ssm_spec.ops.gdn.inner import gdn_tile_config

    device, W = torch.device("cuda"), 4
    lengths, srcs = [W, W, 3], [0, 3, 5]
    inp, pool, qsl, src = _setup(device, (32, 16, 128, 128), lengths, srcs, state_dtype=state_dtype, seed=5,
                                 act_dtype=torch.bfloat16)
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    _, snaps = native_states(inp, pool, src, qsl)
    no_bnd = torch.empty(len(srcs), 0, dtype=torch.int32, device=device)
    tiles = {gdn_tile_config(128, 128, "commit", state_dtype), gdn_tile_config(128, 128, "verify", state_dtype),
             (128, 8, 1), (128, 32, 4), (128, 64, 4), (128, 128, 4)}
    for tile in sorted(tiles):
        for trial in range(W + 1):
            counts = rotating_counts(trial, lengths, W)
            work = pool.clone()
            launch_gdn_commit(work, *rec, qsl, src, i32(counts, device), src, no_bnd, no_bnd, config=tile)
            for b, s in enumerate(srcs):
                want = snaps[int(qsl[b]) + counts[b] - 1] if counts[b] else pool[s]
                assert torch.equal(work[s], want), (tile, trial, b)


def test_tile_override_is_checked_before_launch():
    """A launcher's ``config`` (benchmarks, tuning) that the kernel cannot run is refused before
    anything launches: a BK short of K would silently skip key rows."""
    from ssm_spec.ops.gdn.commit import launch_gdn_commit
    from ssm_spec.ops.gdn.verify import launch_gdn_window

    inp, pool, qsl, src = _setup("cpu", (4, 2, 24, 20), [3], [0])
    T, HV, V = inp.q.shape[0], 4, 20
    rec = (torch.zeros(T, HV, V), torch.zeros(T, 2, 24), torch.zeros(T, HV))
    before = pool.clone()
    for bad in [(16, 8, 1), (32, 12, 1), (32, 8, 3), (), (32, 8), (32, 8.0, 1), (32, True, 1), (32, 1 << 16, 1)]:
        with pytest.raises(ValueError, match="config"):
            launch_gdn_window(*inp.args()[:5], pool, src, qsl, None, torch.zeros(T, HV, V), rec, 0.2, True, config=bad)
        with pytest.raises(ValueError, match="config"):
            launch_gdn_commit(pool, *rec, qsl, src, i32([1], "cpu"), src, torch.empty(1, 0, dtype=torch.int32),
                              torch.empty(1, 0, dtype=torch.int32), config=bad)
    assert torch.equal(pool, before)
