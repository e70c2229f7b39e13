"""The Triton kernels themselves, run eagerly on CPU tensors under ``TRITON_INTERPRET=1``.

Collected only when ``TRITON_INTERPRET=1`` is set before import (``tests/conftest.py``): a
pytest process of its own runs this folder (``.ci/run``'s second command,
``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= pytest tests/interpret``). Kernels are called
through their launchers (the ops would route CPU tensors to the CPU kernels). Activations are
fp32/fp16: the interpreter mishandles bf16 arithmetic.
"""

import os

import pytest
import torch

from ssm_spec import ops, reference
from ssm_spec.ops._validate import no_boundaries
from ssm_spec.ops.gdn.commit import launch_gdn_commit
from ssm_spec.ops.gdn.verify import launch_gdn_window
from ssm_spec.ops.short_conv.commit import launch_short_conv_commit
from ssm_spec.ops.short_conv.verify import launch_short_conv_verify
from tests.helpers import (
    fenced,
    gdn_inputs,
    i32,
    qsl_from_lengths,
    random_pool,
    rel_err,
    rotating_counts,
    same_bits,
)

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 set before import"
NAN = float("nan")


def _triton_verify(inp, pool, src, qsl, snap=None, scale=None, use_qk_l2norm=True):
    T, H, K = inp.q.shape
    HV, V = inp.v.shape[1:]
    out = torch.full((T, HV, V), NAN, dtype=inp.v.dtype)
    rec = None if snap is not None else ops.ReplayRecord(
        torch.full((T, HV, V), NAN), torch.full((T, H, K), NAN), torch.full((T, HV), NAN))
    launch_gdn_window(*inp.args(), pool, src, qsl, snap, out, rec, K**-0.5 if scale is None else scale,
                      use_qk_l2norm)
    return out, rec


def _triton_native(inp, pool, src, qsl):
    T = inp.q.shape[0]
    S = pool.shape[0]
    scratch = torch.cat([pool, torch.full((T, *pool.shape[1:]), NAN, dtype=pool.dtype)])
    _triton_verify(inp, scratch, src, qsl, snap=torch.arange(S, S + T, dtype=torch.int32))
    return scratch[S:]


@pytest.mark.parametrize("shape", [(4, 2, 16, 32), (3, 1, 12, 20)])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.float16])
def test_verify_kernel_matches_cpu_and_reference(shape, act_dtype):
    HV, H, K, V = shape
    qsl = qsl_from_lengths([3, 0, 4, 2], "cpu")
    src = i32([0, 2, -1, 5], "cpu")
    inp = gdn_inputs(int(qsl[-1]) + 1, H, HV, K, V, "cpu", dtype=act_dtype)
    pool = random_pool(6, HV, K, V, "cpu")
    before = pool.clone()
    out, rec = _triton_verify(inp, pool, src, qsl)
    assert same_bits(pool, before)
    cpu_out, cpu_rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    live = torch.zeros(inp.q.shape[0], dtype=torch.bool)
    live[0:3] = live[7:9] = True
    for got, want in zip((out, *rec), (cpu_out, *cpu_rec)):
        assert got[~live].isnan().all(), "padding or outside tokens were written"
        assert rel_err(got[live], want[live]) < (1e-5 if act_dtype == torch.float32 else 2e-3)
    for b, s in [(0, 0), (3, 5)]:
        bos, eos = int(qsl[b]), int(qsl[b + 1])
        ref = reference.gdn_native_step(*inp.window(bos, eos), pool[s], dtype=torch.float64)
        assert rel_err(rec.u[bos:eos], ref.u) < 1e-5


def test_commit_kernel_every_count_is_the_snapshot_state():
    W, HV, H, K, V = 4, 4, 2, 16, 24
    lengths, srcs = [W, W, 2], [1, 0, 4]
    qsl = qsl_from_lengths(lengths, "cpu")
    src = i32(srcs, "cpu")
    inp = gdn_inputs(int(qsl[-1]), H, HV, K, V, "cpu")
    pool = random_pool(16, HV, K, V, "cpu")
    pool[8:] = NAN
    _, rec = _triton_verify(inp, pool, src, qsl)
    snaps = _triton_native(inp, pool, src, qsl)
    for trial in range(W + 1):
        counts = rotating_counts(trial, lengths, W)
        work = pool.clone()
        dst = i32([8, 9, 4], "cpu")  # rows 0, 1 keep their checkpoint; row 2 in place
        bidx = i32([[10, 11], [12, -1], [13, 14]], "cpu")
        boff = i32([[1, 3], [W, 1], [2, 0]], "cpu")
        launch_gdn_commit(work, *rec, qsl, src, i32(counts, "cpu"), dst, bidx, boff)
        written = set()
        for b in range(3):
            n, base = counts[b], int(qsl[b])
            if n:
                assert torch.equal(work[int(dst[b])], snaps[base + n - 1]), (trial, b)
                ref = reference.gdn_native_step(*inp.window(base, base + n), pool[srcs[b]],
                                                dtype=torch.float64).states[-1]
                assert rel_err(work[int(dst[b])], ref) < 1e-5
                written.add(int(dst[b]))
            for j in range(2):
                off, idx = int(boff[b, j]), int(bidx[b, j])
                if idx >= 0 and 1 <= off <= n:
                    assert torch.equal(work[idx], snaps[base + off - 1])
                    written.add(idx)
        for slot in range(16):
            if slot not in written:
                assert same_bits(work[slot], pool[slot]), (trial, slot)


def test_grouped_commit_kernel_and_wild_metadata():
    NL, W, HV, H, K, V = 2, 3, 2, 1, 8, 8
    qsl = qsl_from_lengths([W, W], "cpu")
    src = i32([0, 1], "cpu")
    pools, recs = [], []
    for layer in range(NL):
        inp = gdn_inputs(2 * W, H, HV, K, V, "cpu", gen=torch.Generator().manual_seed(layer))
        pool = random_pool(5, HV, K, V, "cpu", gen=torch.Generator().manual_seed(9 + layer))
        pools.append(pool)
        recs.append(_triton_verify(inp, pool, src, qsl)[1])
    grouped = torch.stack(pools)
    record = [torch.stack(x) for x in zip(*recs)]
    # wild metadata (never validated): count 7 clamps to 3, query_start_loc 40 clamps to T,
    # slot 50 skipped, boundary -9 skipped
    launch_gdn_commit(grouped, *record, i32([0, 3, 40], "cpu"), i32([0, 1, 50], "cpu"),
                      i32([7, 2, 1], "cpu"), i32([2, 3, 1], "cpu"), i32([[-9], [4], [4]], "cpu"),
                      i32([[1], [1], [1]], "cpu"))
    for layer in range(NL):
        single = pools[layer].clone()
        bi, bo = i32([[-1], [4]], "cpu"), i32([[1], [1]], "cpu")
        launch_gdn_commit(single, *recs[layer], qsl, src, i32([3, 2], "cpu"), i32([2, 3], "cpu"), bi, bo)
        assert same_bits(grouped[layer], single)


@pytest.mark.parametrize("ks,dil,bias,act", [(4, 1, True, "silu"), (3, 2, False, "none"), (2, 4, True, "silu")])
def test_short_conv_kernels(ks, dil, bias, act):
    C, S, W = 20, 8, 5
    lc = (ks - 1) * dil
    lengths, srcs = [W, 2, W, 0], [0, 3, -1, 5]
    qsl = qsl_from_lengths(lengths, "cpu")
    src = i32(srcs, "cpu")
    T = int(qsl[-1])
    x = torch.randn(T, 2 * C)[:, ::2]
    w = torch.randn(C, ks)
    b = torch.randn(C) if bias else None
    state = torch.randn(S, lc, C)
    before = state.clone()
    out = torch.full((T, C), NAN)
    rec_x = torch.full((T, C), NAN)
    launch_short_conv_verify(x, w, b, state, src, qsl, out, rec_x, dil, act)
    assert same_bits(state, before)
    cpu_out, cpu_rec = ops.short_conv_verify(x, w, b, state, src, qsl, dilation=dil, activation=act)
    live = torch.ones(T, dtype=torch.bool)
    live[7:12] = False  # the padding row
    assert out[~live].isnan().all() and rec_x[~live].isnan().all()
    assert rel_err(out[live], cpu_out[live]) < 1e-6
    assert torch.equal(rec_x[live], cpu_rec[live])
    for trial in range(W + 1):
        counts = i32(rotating_counts(trial, lengths, W), "cpu")
        bidx, boff = i32([[6, 7], [-1, 1], [2, 2], [4, 4]], "cpu"), i32([[1, 4], [2, 1], [1, 1], [1, 1]], "cpu")
        dst = i32([0, 2, -1, 5], "cpu")  # row 0 in place (overlapping shift)
        got, want = state.clone(), state.clone()
        launch_short_conv_commit(got, rec_x, qsl, src, counts, dst, bidx, boff)
        ops.short_conv_commit(want, cpu_rec, qsl, src, counts, dst, bidx, boff, validate=False)
        assert same_bits(got, want), trial
        grouped = torch.stack([state, state])
        launch_short_conv_commit(grouped, torch.stack([rec_x, rec_x]), qsl, src, counts, dst, bidx, boff)
        assert same_bits(grouped[0], want) and same_bits(grouped[1], want)


def test_no_boundaries_helper_shape():
    bi, bo = no_boundaries(3, "cpu")
    assert bi.shape == (3, 0) and bo.dtype == torch.int32


def test_kernel_guards_skip_and_clamp_wild_metadata():
    """Each kernel's bounds guards, on pools that are the first S slots of a NaN-fenced buffer:
    a missing guard reads NaN from, or writes into, the fence."""
    HV, H, K, V, S, W = 2, 1, 8, 8, 4, 3
    qsl = i32([0, W, 2 * W], "cpu")
    T = 2 * W
    inp = gdn_inputs(T, H, HV, K, V, "cpu")
    pool = random_pool(S, HV, K, V, "cpu")
    _, rec = _triton_verify(inp, pool, i32([0, 1], "cpu"), qsl)
    # verify: slot 9 skipped, the second window [3, 50) clamped to [3, T)
    big, view = fenced(pool)
    out, wild_rec = _triton_verify(inp, view, i32([9, 1], "cpu"), i32([0, W, 50], "cpu"))
    assert out[:W].isnan().all() and wild_rec.u[:W].isnan().all()
    assert same_bits(out[W:], _triton_verify(inp, pool, i32([-1, 1], "cpu"), qsl)[0][W:])
    # snapshot: slot 7 not written
    big, view = fenced(pool)
    launch_gdn_window(*inp.args(), view, i32([0, 1], "cpu"), qsl, i32([2, 7, 3, -1, 7, 2], "cpu"),
                      torch.empty(T, HV, V), None, K**-0.5, True)
    assert big[S:].isnan().all()
    # commit: count 9 clamps to W, dst 6 and boundary 5 skipped
    big, view = fenced(pool)
    launch_gdn_commit(view, *rec, qsl, i32([0, 1], "cpu"), i32([9, 2], "cpu"), i32([2, 6], "cpu"),
                      i32([[5], [3]], "cpu"), i32([[1], [1]], "cpu"))
    want = pool.clone()
    launch_gdn_commit(want, *rec, qsl, i32([0, 1], "cpu"), i32([W, 2], "cpu"), i32([2, -1], "cpu"),
                      i32([[-1], [3]], "cpu"), i32([[1], [1]], "cpu"))
    assert same_bits(view, want) and big[S:].isnan().all()
    # short conv: verify skips slot 9; commit clamps count 9, skips dst 6
    C, lc = 6, 2
    x = torch.randn(T, C)
    state = torch.randn(S, lc, C)
    big, view = fenced(state)
    y = torch.full((T, C), NAN)
    launch_short_conv_verify(x, torch.randn(C, 3), None, view, i32([9, 1], "cpu"), qsl, y,
                             torch.empty(T, C), 1, "silu")
    assert y[:W].isnan().all() and not y[W:].isnan().any()
    launch_short_conv_commit(view, x, qsl, i32([0, 1], "cpu"), i32([9, 2], "cpu"), i32([2, 6], "cpu"),
                             i32([[5], [3]], "cpu"), i32([[1], [1]], "cpu"))
    want = state.clone()
    ops.short_conv_commit(want, x, qsl, i32([0, 1], "cpu"), i32([W, 2], "cpu"), i32([2, -1], "cpu"),
                          i32([[-1], [3]], "cpu"), i32([[1], [1]], "cpu"))
    assert same_bits(view, want) and big[S:].isnan().all()


@pytest.mark.parametrize("counts", [[0, 0, 0], [1, 3, 2], [4, 4, 2], [2, 0, 1]])
def test_folded_kernel_is_commit_then_verify_bit_for_bit(counts):
    """The fold (previous window replayed inside the verify kernel) gives the separate commit
    kernel's state and then the separate verify kernel's outputs and records, bit for bit."""
    W, HV, H, K, V = 4, 4, 2, 16, 24
    lengths, srcs = [W, W, 2], [1, 0, 4]
    qsl = qsl_from_lengths(lengths, "cpu")
    src = i32(srcs, "cpu")
    pool = random_pool(8, HV, K, V, "cpu")
    pool[5:] = NAN  # slots no row owns: must stay as they are
    _, prev = _triton_verify(gdn_inputs(int(qsl[-1]), H, HV, K, V, "cpu"), pool, src, qsl)
    nxt = gdn_inputs(int(qsl[-1]), H, HV, K, V, "cpu", gen=torch.Generator().manual_seed(7))
    n = i32(counts, "cpu")
    separate = pool.clone()
    dst = src
    launch_gdn_commit(separate, *prev, qsl, src, n, dst, *no_boundaries(3, "cpu"))
    out_s, rec_s = _triton_verify(nxt, separate, src, qsl)
    folded = pool.clone()
    T = nxt.q.shape[0]
    out_f = torch.full((T, HV, V), NAN)
    rec_f = ops.ReplayRecord(torch.full((T, HV, V), NAN), torch.full((T, H, K), NAN), torch.full((T, HV), NAN))
    launch_gdn_window(*nxt.args(), folded, src, qsl, None, out_f, rec_f, K**-0.5, True,
                      fold=(*prev, qsl[:-1].contiguous(), n))
    assert same_bits(folded, separate)
    for got, want in zip((out_f, *rec_f), (out_s, *rec_s)):
        assert same_bits(got, want)


def test_bits_do_not_depend_on_the_tile():
    """Verify, the snapshot and commit (every count) on four tiles, ragged windows, a padding
    row and a masked last V tile (V=24): outputs, records and states bit-identical to the
    first tile's, commit on the snapshot's states. The interpreter has no layouts, so this
    checks the code's own order (``kdot``) and the tiling (the grid over V, the masks); the
    layouts are tests/ops/gdn/test_ops.py::test_bits_do_not_depend_on_the_tile_on_gpu's."""
    W, HV, H, K, V = 4, 4, 2, 16, 24
    lengths, srcs = [W, 2, 3], [0, -1, 3]
    qsl = qsl_from_lengths(lengths, "cpu")
    src = i32(srcs, "cpu")
    inp = gdn_inputs(int(qsl[-1]), H, HV, K, V, "cpu")
    pool = random_pool(8, HV, K, V, "cpu")
    first = None
    for tile in [(16, 8, 1), (16, 16, 2), (16, 32, 4), (16, 4, 1)]:
        T = inp.q.shape[0]
        out = torch.full((T, HV, V), NAN)
        rec = ops.ReplayRecord(torch.full((T, HV, V), NAN), torch.full((T, H, K), NAN), torch.full((T, HV), NAN))
        launch_gdn_window(*inp.args(), pool, src, qsl, None, out, rec, K**-0.5, True, config=tile)
        S = pool.shape[0]
        snaps = torch.cat([pool, torch.full((T, HV, K, V), NAN)])
        snap_out = torch.full((T, HV, V), NAN)
        launch_gdn_window(*inp.args(), snaps, src, qsl, torch.arange(S, S + T, dtype=torch.int32), snap_out, None,
                          K**-0.5, True, config=tile)
        assert same_bits(snap_out, out)
        commits = []
        for n in range(W + 1):
            counts = [min(n, length) for length in lengths]
            work = pool.clone()
            launch_gdn_commit(work, *rec, qsl, src, i32(counts, "cpu"), src, *no_boundaries(3, "cpu"), config=tile)
            for b, s in enumerate(srcs):
                if s >= 0:
                    want = snaps[S + int(qsl[b]) + counts[b] - 1] if counts[b] else pool[s]
                    assert torch.equal(work[s], want), (tile, n, b)
            commits.append(work)
        bits = (out, *rec, snaps, *commits)
        if first is None:
            first = bits
        for got, want in zip(bits, first):
            assert same_bits(got, want), tile


@pytest.fixture
def load_addresses(monkeypatch):
    """Every address the interpreted kernels load from with its mask on (a list of int arrays),
    by wrapping the interpreter's masked load. A read past a window is invisible in the results
    (the prefetched value is never used), so the kernels' prefetch masks are tested here."""
    import numpy as np
    from triton.runtime import interpreter

    seen = []
    original = interpreter.InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, *rest):
        p = np.asarray(ptrs.data).reshape(-1).astype(np.int64)
        m = np.broadcast_to(np.asarray(mask.data).reshape(-1) if mask is not None else True, p.shape)
        seen.append(p[m.astype(bool)])
        return original(self, ptrs, mask, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", spy)
    return seen


def _rows_read(seen, *tensors):
    """Dim-0 row indices of ``tensors`` (contiguous) that the recorded loads touched."""
    import numpy as np

    addrs = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int64)
    seen.clear()
    rows = set()
    for t in tensors:
        base, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
        hit = addrs[(addrs >= base) & (addrs < base + nbytes)]
        rows |= set(((hit - base) // (t.stride(0) * t.element_size())).tolist())
    return rows, addrs.size


def test_prefetch_reads_no_token_outside_a_window(load_addresses):
    """The kernels load the next token (verify: q, k, v, g, beta; commit and the fold: the
    next record) ahead of use. No load may touch a token past a row's window or accepted count,
    nor a padding row's tokens, nor rows past the buffers' ends (the last window ends at T)."""
    HV, H, K, V = 4, 2, 16, 24
    qsl, T = i32([0, 3, 7, 9], "cpu"), 9
    inp = gdn_inputs(T, H, HV, K, V, "cpu", strided=False)
    pool = random_pool(4, HV, K, V, "cpu")
    out = torch.empty(T, HV, V)
    rec = (torch.empty(T, HV, V), torch.empty(T, H, K), torch.empty(T, HV))
    acts = (inp.q, inp.k, inp.v, inp.g, inp.beta)

    launch_gdn_window(*acts, pool, i32([0, -1, 2], "cpu"), qsl, None, out, rec, K**-0.5, True)
    rows, n = _rows_read(load_addresses, *acts)
    assert n > 0 and rows == {0, 1, 2, 7, 8}  # row 1 is padding: its tokens 3..6 are never read

    for counts in ([3, 4, 2], [1, 0, 2], [0, 0, 0]):
        launch_gdn_commit(pool.clone(), *rec, qsl, i32([0, 1, 2], "cpu"), i32(counts, "cpu"), i32([0, 1, 2], "cpu"),
                          *no_boundaries(3, "cpu"))
        rows, _ = _rows_read(load_addresses, *rec)
        assert rows == {int(qsl[b]) + t for b in range(3) for t in range(counts[b])}, counts

    TP = 9
    prev = (torch.randn(TP, HV, V), torch.randn(TP, H, K), torch.rand(TP, HV))
    for pstart, pn in (([0, 3, 7], [3, 4, 2]), ([0, 3, 7], [1, 0, 5]), ([8, 9, 20], [5, 5, 5])):
        launch_gdn_window(*acts, pool.clone(), i32([0, 1, 2], "cpu"), qsl, None, out, rec, K**-0.5, True,
                          fold=(*prev, i32(pstart, "cpu"), i32(pn, "cpu")))
        rows, _ = _rows_read(load_addresses, *prev)
        want = set()
        for p0, n in zip(pstart, pn):
            p0 = min(max(p0, 0), TP)
            want |= set(range(p0, p0 + min(max(n, 0), TP - p0)))
        assert rows == want, (pstart, pn)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_native_engine_baseline_matches_reference(state_dtype):
    """The benchmarks' engine baseline (``benchmarks/native_engine.py``) computes the GDN window:
    each row from the slot of its last accepted token, every token's state into its own slot
    (others untouched), outputs and states near the float64 reference."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from native_engine import native_engine_verify

    B, W, H, HV, K, V = 3, 3, 1, 2, 16, 12
    inp = gdn_inputs(B * W, H, HV, K, V, "cpu")
    S = B * W + 2
    pool = random_pool(S, HV, K, V, "cpu").to(state_dtype)
    idx = torch.arange(S, dtype=torch.int32)[: B * W].view(B, W).flip(0).contiguous()
    idx[1, 1] = -1  # a token whose state is not kept
    n = i32([2, 1, 3], "cpu")
    before = pool.clone()
    out = torch.full((B * W, HV, V), NAN)
    native_engine_verify(*inp.args(), pool, idx, n, out, K**-0.5)
    for b in range(B):
        src = int(idx[b, int(n[b]) - 1])
        ref = reference.gdn_native_step(*inp.window(b * W, (b + 1) * W), before[src], dtype=torch.float64)
        assert rel_err(out[b * W:(b + 1) * W], ref.out) < 1e-5
        for t in range(W):
            if int(idx[b, t]) >= 0:
                tol = 1e-5 if state_dtype == torch.float32 else 1e-2
                assert rel_err(pool[int(idx[b, t])], ref.states[t]) < tol
    assert same_bits(pool[B * W:], before[B * W:])


@pytest.mark.parametrize("shape", [(4, 2, 16, 24), (2, 2, 12, 20)])
def test_closed_form_kernel_matches_cpu_twin_in_every_tile(shape):
    """Fast mode's kernel (plain and ring: fold, history, nothing pending, an empty window) near
    its CPU twin; bits equal across tiles (a masked V tile included); padding rows and tokens
    outside windows untouched."""
    from ssm_spec.ops.gdn.closed_form import RecordRing, closed_form_cpu, launch_closed_form

    HV, H, K, V = shape
    qsl = qsl_from_lengths([3, 0, 4, 2, 1], "cpu")
    src = i32([0, 2, -1, 5, 6], "cpu")
    T = int(qsl[-1]) + 1
    inp = gdn_inputs(T, H, HV, K, V, "cpu")
    pool = random_pool(7, HV, K, V, "cpu")
    R, L = 8, 4
    ring0 = RecordRing(*(torch.randn_like(x) for x in RecordRing.zeros(7, R, H, HV, K, V)))
    ring0 = RecordRing(ring0.u, ring0.k / ring0.k.norm(dim=-1, keepdim=True), -ring0.g.abs())
    start, count = i32([5, 1, 0, 3, 2], "cpu"), i32([2, 3, 0, 1, 4], "cpu")

    def bufs():
        return (torch.full((T, HV, V), NAN), (torch.full((T, HV, V), NAN), torch.full((T, H, K), NAN),
                                              torch.full((T, HV), NAN)))

    runs = []
    for tile in ((16, 8, 1), (16, 16, 2)):
        out, rec = bufs()
        launch_closed_form(*inp.args(), pool, src, qsl, out, rec, 4, K**-0.5, True, config=tile)
        p2, r2, o2 = pool.clone(), RecordRing(*(x.clone() for x in ring0)), torch.full((T, HV, V), NAN)
        launch_closed_form(*inp.args(), p2, src, qsl, o2, r2, 4, K**-0.5, True, pending=(start, count, L),
                           config=tile)
        runs.append((out, *rec, o2, p2, *r2))
    for a, b in zip(*runs):
        assert same_bits(a, b)
    out_c, rec_c = bufs()
    closed_form_cpu(*inp.args(), pool, src, qsl, out_c, rec_c, 4, K**-0.5, True)
    p_c, r_c, o2_c = pool.clone(), RecordRing(*(x.clone() for x in ring0)), torch.full((T, HV, V), NAN)
    closed_form_cpu(*inp.args(), p_c, src, qsl, o2_c, r_c, 4, K**-0.5, True, pending=(start, count, L))
    for got, want in zip(runs[0], (out_c, *rec_c, o2_c, p_c, *r_c)):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        live = ~torch.isnan(want)
        assert rel_err(got[live], want[live]) < 1e-5
    assert torch.equal(runs[0][5][[1, 3, 4]], pool[[1, 3, 4]])  # slots no row names


@pytest.mark.parametrize("case", ["lazy16", "lazy16-raw-extreme-gates", "flush"])
def test_closed_form_ring_kernel_matches_cpu_twin_past_four_pending(case):
    """The ring form with more than 4 pending records (``PP = 16`` or 32: the per-record fold loop
    and a ``[W, 16]`` history block), pending counts up to ``R - max_window`` wrapping round the
    ring, folds, history rows, empty windows, a null slot and one past the pool; ``K`` not a power
    of two and a masked V tile; ``use_qk_l2norm=False`` with gates and betas at their extremes
    (g = -50 and 0, beta 0 and 1), and a flush (``max_pending = 0``, every window empty). Near the
    CPU twin, bits equal across tiles; the ring's positions that hold no pending record are NaN and
    must not be read; whatever the twin leaves (slots no row names, states of rows that do not
    fold, ring positions, tokens outside windows) the kernel leaves bit for bit. The plain form on
    the same windows too."""
    from ssm_spec.ops.gdn.closed_form import RecordRing, closed_form_cpu, launch_closed_form, pending_block

    HV, H, K, V = 2, 1, 12, 20
    if case == "flush":
        L, max_window, R = 0, 0, 20  # a pool of max_pending 16, max_window 4, flushed: PP = 32
        lengths = [0] * 9
        counts, starts = [16, 1, 20, 0, 5, 3, 7, 4, 2], [19, 0, 5, 3, 17, 2, 4, 1, 6]
    else:
        L, max_window, R = 16, 4, 20  # ring_positions(16, 4): PP = 16
        # fold (16 + 4 > 16, wrapping) / fold with W=1 / history (12 + 4 = 16) / history, W=1 /
        # nothing pending / pending, empty window / fold of 13 / null slot / slot past the pool
        lengths = [4, 1, 4, 0, 4, 0, 3, 2, 4]
        counts, starts = [16, 16, 12, 15, 0, 16, 14, 3, 9], [19, 8, 15, 18, 4, 0, 7, 1, 2]
    slots = [0, 1, 2, 3, 4, 5, 6, -1, 9]
    S = 9  # slots 7 and 8: no row names them
    qsl = qsl_from_lengths(lengths, "cpu")
    T = int(qsl[-1]) + 1  # the last token lies outside every window
    src, start, count = i32(slots, "cpu"), i32(starts, "cpu"), i32(counts, "cpu")
    use_qk_l2norm = case != "lazy16-raw-extreme-gates"
    inp = gdn_inputs(T, H, HV, K, V, "cpu")
    gen = torch.Generator().manual_seed(3)
    ring0 = RecordRing(torch.randn(S, R, HV, V, generator=gen), torch.randn(S, R, H, K, generator=gen),
                       -torch.rand(S, R, HV, generator=gen))
    ring0 = RecordRing(ring0.u, ring0.k / ring0.k.norm(dim=-1, keepdim=True), ring0.g)
    if not use_qk_l2norm:  # g -50 / 0 / random, beta 0 / 1 / random, by token and head
        pick = torch.arange(T * HV).view(T, HV)
        inp.g.copy_(torch.where(pick % 3 == 0, -50.0, torch.where(pick % 3 == 1, 0.0, inp.g)))
        inp.beta.copy_(torch.where(pick // 3 % 3 == 0, 0.0, torch.where(pick // 3 % 3 == 1, 1.0, inp.beta)))
        pick = torch.arange(S * R * HV).view(S, R, HV) % 3
        ring0.g.copy_(torch.where(pick == 0, -50.0, torch.where(pick == 1, 0.0, ring0.g)))
    PP = pending_block(R, max_window)
    assert PP > 4
    for b, s in enumerate(slots):  # positions without a pending record: NaN
        if 0 <= s < S:
            free = torch.ones(R, dtype=torch.bool)
            free[[(starts[b] + j) % R for j in range(min(counts[b], R, PP))]] = False
            for x in ring0:
                x[s, free] = NAN
    pool = random_pool(S, HV, K, V, "cpu")

    def bufs():
        return torch.full((T, HV, V), NAN), pool.clone(), RecordRing(*(x.clone() for x in ring0))

    runs = []
    for tile in ((16, 8, 1), (16, 32, 2)):
        out, p, r = bufs()
        launch_closed_form(*inp.args(), p, src, qsl, out, r, max_window, K**-0.5, use_qk_l2norm,
                           pending=(start, count, L), config=tile)
        runs.append((out, p, *r))
    for a, b in zip(*runs):
        assert same_bits(a, b)
    out, p, r = bufs()
    closed_form_cpu(*inp.args(), p, src, qsl, out, r, max_window, K**-0.5, use_qk_l2norm, pending=(start, count, L))
    want = (out, p, *r)
    for got, ref, before in zip(runs[0], want, (out, pool, *ring0)):
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        live = ~torch.isnan(ref)
        assert rel_err(got[live], ref[live]) < 1e-5
        if got is not runs[0][0]:  # what the twin leaves, bit for bit
            kept = (ref.view(torch.int32) == before.view(torch.int32))
            assert torch.equal(got.view(torch.int32)[kept], before.view(torch.int32)[kept])
    for b, s in enumerate(slots):
        bos, eos = int(qsl[b]), int(qsl[b + 1])
        if eos > bos and 0 <= s < S:
            assert rel_err(runs[0][0][bos:eos], out[bos:eos]) < 1e-5, b
        if 0 <= s < S and not same_bits(p[s], pool[s]):  # a folded state
            assert rel_err(runs[0][1][s], p[s]) < 1e-5, s
    folded = [s for s in range(S) if not same_bits(p[s], pool[s])]
    assert folded == ([0, 1, 2, 4, 5, 6] if case == "flush" else [0, 1, 6])
    assert same_bits(runs[0][1][7:], pool[7:]) and runs[0][0][-1].isnan().all()
    if case == "flush":
        return
    plain = []  # the plain form (records to token rows, the state read only) on the same windows
    for tile in ((16, 8, 1), (16, 32, 2)):
        out, p, _ = bufs()
        rec = (torch.full((T, HV, V), NAN), torch.full((T, H, K), NAN), torch.full((T, HV), NAN))
        launch_closed_form(*inp.args(), p, src, qsl, out, rec, max_window, K**-0.5, use_qk_l2norm, config=tile)
        assert same_bits(p, pool)
        plain.append((out, *rec))
    out, p, _ = bufs()
    rec = (torch.full((T, HV, V), NAN), torch.full((T, H, K), NAN), torch.full((T, HV), NAN))
    closed_form_cpu(*inp.args(), p, src, qsl, out, rec, max_window, K**-0.5, use_qk_l2norm)
    for a, b, ref in zip(*plain, (out, *rec)):
        assert same_bits(a, b) and torch.equal(torch.isnan(a), torch.isnan(ref))
        assert rel_err(a[~torch.isnan(ref)], ref[~torch.isnan(ref)]) < 1e-5


def test_fold_only_launch_with_a_max_window_equals_the_one_with_zero():
    """The launch ``StatePool.flush`` makes (the closed-form op with empty windows and
    ``max_pending = 0``; this test calls the op, not the pool) with the pool's ``max_window``
    (W = 4: PP = 16, a step's binary) instead of 0 (PP = 32): for every valid pending count (up to
    ``max(max_pending, W)`` = 16, wrapping round the ring) the folded states are the same bits,
    and nothing else is written."""
    from ssm_spec.ops.gdn.closed_form import RecordRing, launch_closed_form, pending_block

    HV, H, K, V, R, S = 2, 1, 12, 20, 20, 6
    assert (pending_block(R, 4), pending_block(R, 0)) == (16, 32)
    counts, starts = [16, 1, 9, 0, 5, 13], [19, 0, 15, 3, 17, 2]
    src, start, count = i32(range(S), "cpu"), i32(starts, "cpu"), i32(counts, "cpu")
    qsl = torch.zeros(S + 1, dtype=torch.int32)
    inp = gdn_inputs(0, H, HV, K, V, "cpu")
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(S, R, H, K, generator=gen)
    ring0 = RecordRing(torch.randn(S, R, HV, V, generator=gen), k / k.norm(dim=-1, keepdim=True),
                       -torch.rand(S, R, HV, generator=gen))
    pool = random_pool(S, HV, K, V, "cpu")
    pools = []
    for max_window in (4, 0):
        p, r = pool.clone(), RecordRing(*(x.clone() for x in ring0))
        launch_closed_form(*inp.args(), p, src, qsl, torch.empty(0, HV, V), r, max_window, K**-0.5, True,
                           pending=(start, count, 0))
        assert all(same_bits(a, b) for a, b in zip(r, ring0))
        pools.append(p)
    assert same_bits(pools[0], pools[1])
    assert [s for s in range(S) if not same_bits(pools[0][s], pool[s])] == [0, 1, 2, 4, 5]


def test_closed_form_key_rows_per_chunk_do_not_change_bits():
    """The state loop's rows per chunk (``key_rows``, swept by ``scripts/tune_closed_form.py``)
    and its loads a chunk ahead (``prefetch``): 1, 4 and 16 rows, 4 and 16 with prefetch, give
    the same outputs, rings and states bit for bit on rows that fold (15 pending under L = 16),
    take the history path (3 and 12 pending) or have nothing pending, with a bf16 state (the
    plain form's outputs and records: 4 rows with prefetch == 1 row without); a chunk that is
    not a power of two <= BK, a pipelining depth below 1, a non-int, a non-bool prefetch or a
    bad register cap is a ``ValueError`` before any launch, with an empty batch too."""
    from ssm_spec.ops.gdn.closed_form import RecordRing, launch_closed_form, ring_positions

    HV, H, K, V, L, W = 2, 1, 16, 8, 16, 4
    wins, counts, starts = [4, 4, 3, 4], [15, 12, 3, 0], [5, 19, 0, 9]
    S, R, T = len(wins), ring_positions(L, W), sum(wins)
    gen = torch.Generator().manual_seed(11)
    inp = gdn_inputs(T, H, HV, K, V, "cpu", gen=gen)
    qsl = i32([0, 4, 8, 11, 15], "cpu")
    src, start, count = i32(range(S), "cpu"), i32(starts, "cpu"), i32(counts, "cpu")
    k = torch.randn(S, R, H, K, generator=gen)
    ring0 = RecordRing(torch.randn(S, R, HV, V, generator=gen), k / k.norm(dim=-1, keepdim=True),
                       -torch.rand(S, R, HV, generator=gen) * 2)
    pool = random_pool(S, HV, K, V, "cpu", dtype=torch.bfloat16, gen=gen)
    results = []
    for rows, prefetch in ((1, False), (4, False), (16, False), (4, True), (16, True)):
        p, r = pool.clone(), RecordRing(*(x.clone() for x in ring0))
        out = torch.full((T, HV, V), float("nan"))
        launch_closed_form(*inp.args(), p, src, qsl, out, r, W, K**-0.5, True, pending=(start, count, L),
                           key_rows=rows, prefetch=prefetch)
        results.append((out, p, *r))
    plain = []
    for rows, prefetch in ((1, False), (4, True)):  # the plain form shares the state loop
        out = torch.full((T, HV, V), float("nan"))
        rec = (torch.full((T, HV, V), float("nan")), torch.full((T, H, K), float("nan")),
               torch.full((T, HV), float("nan")))
        launch_closed_form(*inp.args(), pool, src, qsl, out, rec, W, K**-0.5, True, key_rows=rows,
                           prefetch=prefetch)
        plain.append((out, *rec))
    assert all(same_bits(a, b) for a, b in zip(*plain))
    for other in results[1:]:
        assert all(same_bits(a, b) for a, b in zip(results[0], other))
    assert not same_bits(results[0][1][0], pool[0]) and same_bits(results[0][1][1:], pool[1:])  # only row 0 folds
    for bad in (3, 32, 0):
        p = pool.clone()
        with pytest.raises(ValueError, match="key_rows"):
            launch_closed_form(*inp.args(), p, src, qsl, out, RecordRing(*(x.clone() for x in ring0)), W, K**-0.5,
                               True, pending=(start, count, L), key_rows=bad)
        assert same_bits(p, pool)
    for bad in (dict(stages=0), dict(stages=1.7), dict(key_rows=2.5), dict(key_rows=True), dict(max_registers=-5),
                dict(prefetch=1)):
        p = pool.clone()
        with pytest.raises(ValueError, match=next(iter(bad))):  # pipelining depth, non-ints, register cap
            launch_closed_form(*inp.args(), p, src, qsl, out, RecordRing(*(x.clone() for x in ring0)), W, K**-0.5,
                               True, pending=(start, count, L), **bad)
        assert same_bits(p, pool)
    with pytest.raises(ValueError, match="stages"):  # an empty batch launches nothing but is checked too
        launch_closed_form(*inp.args(), pool, src[:0], qsl[:1], out, ring0, W, K**-0.5, True,
                           pending=(start[:0], count[:0], L), stages=0)


def test_closed_form_fold_past_four_pending_is_the_record_order_fma_chain():
    """The fold with ``PP = 16`` (a runtime loop over blocks of 4 records, the last block masked
    past the count) at counts 5, 7, 8, 15, 16 (and 1, 4), starts wrapping round the ring, with and
    without a window. With the pending decays at 0 (every ``exp`` is exactly 1) the stored state
    is, bit for bit, one FMA chain per element in record order, ``fma(k̂_p, u_p, acc)`` from the
    checkpoint: ring positions past the count hold NaN / inf and are never read, a masked record
    adds exactly nothing (an element that is ``-0.0`` through the chain stays ``-0.0``; the
    interpreter keeps a ``-0.0`` literal's sign where compiled Triton does not, hence the kernel's
    ``_or_neg_zero``). With random and extreme decays: near the CPU twin, bits equal across tiles."""
    import numpy as np
    from triton._C.libtriton import interpreter as _interp

    from ssm_spec.ops.gdn.closed_form import RecordRing, closed_form_cpu, launch_closed_form, pending_block

    HV, H, K, V = 2, 1, 12, 20
    L, max_window, R = 0, 4, 20  # every row with something pending folds; PP = next_pow2(16)
    assert pending_block(R, max_window) == 16
    counts = [5, 7, 8, 15, 16, 1, 4]
    starts = [17, 0, 15, 9, 4, 19, 18]
    lengths = [4, 0, 4, 0, 4, 1, 0]
    S = len(counts)
    qsl = qsl_from_lengths(lengths, "cpu")
    T = int(qsl[-1])
    src, start, count = i32(list(range(S)), "cpu"), i32(starts, "cpu"), i32(counts, "cpu")
    inp = gdn_inputs(T, H, HV, K, V, "cpu")
    gen = torch.Generator().manual_seed(5)
    ring0 = RecordRing(torch.randn(S, R, HV, V, generator=gen), torch.randn(S, R, H, K, generator=gen),
                       -torch.rand(S, R, HV, generator=gen) * 2)
    ring0 = RecordRing(ring0.u, ring0.k / ring0.k.norm(dim=-1, keepdim=True), ring0.g)
    ring0.g[:, ::5] = -50.0
    ring0.g[:, 1::5] = 0.0
    pool = random_pool(S, HV, K, V, "cpu")
    ring0.k[..., 3] = ring0.k[..., 3].abs()  # k̂ row 3 > 0 and u column 5 = -0.0: every term -0.0
    ring0.u[..., 5] = -0.0
    pool[:, :, 3, 5] = -0.0
    pending = torch.zeros(S, R, dtype=torch.bool)
    for s in range(S):
        pending[s, [(starts[s] + j) % R for j in range(counts[s])]] = True
    garbage = torch.where(torch.arange(R) % 2 == 0, NAN, float("inf"))[None].expand(S, R)
    for x in ring0:  # positions without a pending record: NaN / inf, never read
        x[~pending] = garbage[~pending].reshape(-1, *[1] * (x.dim() - 2))

    def launch(ring, tile):
        p, r, out = pool.clone(), RecordRing(*(x.clone() for x in ring)), torch.full((T, HV, V), NAN)
        launch_closed_form(*inp.args(), p, src, qsl, out, r, max_window, K**-0.5, True, pending=(start, count, L),
                           config=tile)
        return p, out, r

    # decays 0: the stored state is the record-order FMA chain, bit for bit
    flat = RecordRing(ring0.u, ring0.k, torch.where(pending[:, :, None], 0.0, ring0.g))
    state = launch(flat, (16, 8, 1))[0]
    for s in range(S):
        acc = pool[s].numpy().copy()  # [HV, K, V]; exp(G_P) = 1
        for j in range(counts[s]):
            pos = (starts[s] + j) % R
            k_hat = ring0.k[s, pos].repeat_interleave(HV // H, 0).numpy()  # exp(G_P - G_p) = 1
            acc = _interp.fma_fp32(*np.broadcast_arrays(k_hat[:, :, None], ring0.u[s, pos][:, None, :].numpy(), acc))
        assert same_bits(state[s], torch.from_numpy(acc)), s
    assert torch.signbit(state[:, :, 3, 5]).all() and (state[:, :, 3, 5] == 0).all()
    # random and extreme decays: near the twin, bits equal across tiles
    runs = [launch(ring0, tile) for tile in ((16, 8, 1), (16, 32, 2))]
    for a, b in zip(runs[0][:2], runs[1][:2]):
        assert same_bits(a, b)
    p, r, out = pool.clone(), RecordRing(*(x.clone() for x in ring0)), torch.full((T, HV, V), NAN)
    closed_form_cpu(*inp.args(), p, src, qsl, out, r, max_window, K**-0.5, True, pending=(start, count, L))
    assert rel_err(runs[0][0], p) < 1e-5 and rel_err(runs[0][1], out) < 1e-5
    assert torch.signbit(runs[0][0][:, :, 3, 5]).all()


def test_tune_closed_form_smoke_run_sweeps_depths_and_checks_bits(tmp_path):
    """``scripts/tune_closed_form.py --device cpu`` (its documented smoke run) with a stages
    sweep: every form timed for each depth, bits equal to the first variant's, JSON written; a
    sweep whose every variant is refused fails."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "tune_closed_form.py"
    spec = importlib.util.spec_from_file_location("tune_closed_form", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    out = tmp_path / "tune.json"
    assert tune.main(["--device", "cpu", "--windows", "2", "--tiles", "16:1", "--stages", "1,2",
                      "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["stages"] for r in rows] == [1, 2] and rows[1]["bits_equal_first_tile"] is True
    assert all(r[f"{n}_us"] > 0 for r in rows for n in ("plain", "lazy_hist", "lazy_fold", "folded"))
    assert tune.main(["--device", "cpu", "--windows", "2", "--tiles", "16:1", "--stages", "0"]) == 1
