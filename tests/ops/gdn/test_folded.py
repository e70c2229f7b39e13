"""gdn_folded_verify: the previous step's commit folded into this step's verify (one
state read and one write per step). Bit-identical to gdn_commit followed by gdn_verify."""

import pytest
import torch

from ssm_spec import ops
from tests.helpers import (
    gdn_inputs,
    i32,
    pool_states,
    qsl_from_lengths,
    random_pool,
    randomize_,
    run_stack,
    same_bits,
)

NAN = float("nan")
W, HV, H, K, V, S = 4, 4, 2, 16, 32, 10


def _steps(device, dtype, lengths, srcs, counts, seed=0, widths=(HV, H, K, V)):
    """A previous verify, then the next step both ways. Returns (separate, folded) as
    ``(pool, out, record)`` each, plus the live token mask of the next step."""
    HV, H, K, V = widths
    qsl = qsl_from_lengths(lengths, device)
    src = i32(srcs, device)
    pool = random_pool(S, HV, K, V, device, dtype=dtype, gen=torch.Generator().manual_seed(seed))
    used = [s for s in srcs if s >= 0]
    free = [s for s in range(S) if s not in used]
    pool[free] = NAN
    T = int(qsl[-1])
    _, prev = ops.gdn_verify(*gdn_inputs(T, H, HV, K, V, device).args(), pool, src, qsl)
    nxt = gdn_inputs(T, H, HV, K, V, device, gen=torch.Generator().manual_seed(seed + 1))
    n = i32(counts, device)
    separate = pool.clone()
    ops.gdn_commit(separate, prev, qsl, src, n)
    out_s, rec_s = ops.gdn_verify(*nxt.args(), separate, src, qsl)
    folded = pool.clone()
    out_f, rec_f = ops.gdn_folded_verify(*nxt.args(), folded, src, qsl, prev, qsl[:-1].clone(), n)
    live = torch.zeros(T, dtype=torch.bool)
    for b, s in enumerate(srcs):
        if s >= 0:
            live[int(qsl[b]):int(qsl[b + 1])] = True
    return (separate, out_s, rec_s), (folded, out_f, rec_f), live.to(device), free


@pytest.mark.parametrize("widths", [(HV, H, K, V), (32, 16, 128, 128)], ids=["small", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trial", range(W + 1))
def test_folded_equals_commit_then_verify_bit_for_bit(device, dtype, trial, widths):
    """Every count 0..W, a padding row, ragged windows; a bf16 pool rounds the folded state
    exactly as the separate path's store and reload. At Qwen3-Next widths the CUDA kernels run
    their measured tiles (the fold on the verify table's tile, the separate commit on its own)."""
    lengths, srcs = [W, 2, 0, W, 3], [3, 0, -1, 7, 5]
    counts = [min(trial, n) for n in lengths]
    counts[1] = (trial + 1) % 3
    (s_pool, s_out, s_rec), (f_pool, f_out, f_rec), live, free = _steps(device, dtype, lengths, srcs, counts,
                                                                        widths=widths)
    assert same_bits(f_pool, s_pool)
    assert same_bits(f_pool[free], s_pool[free]) and f_pool[free].isnan().all()  # untouched
    assert same_bits(f_out[live], s_out[live])
    for a, b in zip(f_rec, s_rec):
        assert same_bits(a[live], b[live])


def test_zero_counts_leave_the_pool_untouched(device):
    (s_pool, _, _), (f_pool, _, _), _, _ = _steps(device, torch.float32, [W, W], [1, 2], [0, 0], seed=3)
    before = random_pool(S, HV, K, V, device, gen=torch.Generator().manual_seed(3))
    assert same_bits(f_pool[[1, 2]], before[[1, 2]]) and same_bits(f_pool, s_pool)


def _args(device):
    qsl = qsl_from_lengths([W, W], device)
    src = i32([1, 2], device)
    pool = random_pool(S, HV, K, V, device)
    inp = gdn_inputs(2 * W, H, HV, K, V, device)
    _, prev = ops.gdn_verify(*inp.args(), pool, src, qsl)
    return inp, pool, src, qsl, prev


@pytest.mark.parametrize("case", ["start_past_end", "negative_count", "shared_slot", "overlap", "prev_shape",
                                  "slot_range"])
def test_malformed_raises_and_changes_nothing(device, case):
    inp, pool, src, qsl, prev = _args(device)
    start, n = qsl[:-1].clone(), i32([2, 3], device)
    kw = {}
    if case == "start_past_end":
        start = i32([0, 2 * W - 1], device)
    elif case == "negative_count":
        n = i32([-1, 0], device)
    elif case == "shared_slot":
        src = i32([2, 2], device)
    elif case == "overlap":
        kw["record"] = prev
    elif case == "prev_shape":
        prev = ops.ReplayRecord(prev.u[:, :1], prev.k, prev.decay)
    elif case == "slot_range":
        src = i32([1, S], device)
    before = pool.clone()
    with pytest.raises(ValueError, match="gdn_folded_verify"):
        ops.gdn_folded_verify(*inp.args(), pool, src, qsl, prev, start, n, **kw)
    assert same_bits(pool, before)


def test_opcheck(device):
    inp, pool, src, qsl, prev = _args(device)
    T = inp.q.shape[0]
    out = torch.empty(T, HV, V, device=device)
    rec = [torch.empty(T, HV, V, device=device), torch.empty(T, H, K, device=device), torch.empty(T, HV, device=device)]
    torch.library.opcheck(torch.ops.ssm_spec.gdn_folded_verify.default,
                          (*inp.args(), pool, src, qsl, out, *rec, *prev, qsl[:-1].clone(), i32([2, 3], device),
                           K**-0.5, True))


def test_compile_fullgraph_equals_eager(device):
    inp, pool, src, qsl, prev = _args(device)
    n = i32([3, 1], device)
    start = qsl[:-1].clone()
    eager_pool = pool.clone()
    want, _ = ops.gdn_folded_verify(*inp.args(), eager_pool, src, qsl, prev, start, n)
    torch._dynamo.reset()
    f = torch.compile(lambda *a: ops.gdn_folded_verify(*a)[0], fullgraph=True)
    got = f(*inp.args(), pool, src, qsl, prev, start, n)
    assert same_bits(got, want) and same_bits(pool, eager_pool)


# ----------------------------------------------------------------------------- the pool's folded mode


def _layers(device, seed=0):
    from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv
    torch.manual_seed(seed)
    layers = [RecoverGatedDeltaNet(32, 2, 4, 16, 16, device=device), RecoverShortConv(32, 3, dilation=2, device=device),
              RecoverGatedDeltaNet(32, 2, 4, 16, 16, device=device)]
    return randomize_(layers, 0.3)


def _pair(device, dtype=torch.float32):
    """A plain pool and a folded one for the same layers, both after the same prefill."""
    from ssm_spec import RecoverSSMMetadata, StatePool
    layers = _layers(device)
    pools = [StatePool(layers, num_slots=6, max_tokens=16, dtype=dtype, device=device, folded=f) for f in (False, True)]
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(1)).to(device)
    md = RecoverSSMMetadata.build([8, 12], [True, True], [0, 0], [4, 1], num_slots=6, device=device)
    for pool in pools:
        run_stack(layers, x, md, pool)
    return layers, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_pool_decodes_like_the_separate_commit(device, dtype):
    """30 steps with random windows and counts (0..W, padding rows, reordered rows): outputs
    equal the separate commit's bit for bit every step, and after a flush so do the states."""
    from ssm_spec import NULL_SLOT, RecoverSSMMetadata, commit
    layers, (plain, folded) = _pair(device, dtype)
    gen = torch.Generator().manual_seed(2)
    done = {4: 8, 1: 12}
    for step in range(30):
        order = [4, 1] if step % 3 else [1, NULL_SLOT, 4]  # rows reorder; a padding row
        lens = [0 if s < 0 else int(torch.randint(1, W + 1, (), generator=gen)) for s in order]
        md = RecoverSSMMetadata.build(lens, [False] * len(order), [done.get(s, 0) for s in order], order,
                                      num_slots=6, device=device)
        x = torch.randn(sum(lens), 32, generator=gen).to(device)
        y_plain = run_stack(layers, x, md, plain)
        y_fold = run_stack(layers, x, md, folded)
        assert same_bits(y_fold, y_plain), step
        n = [int(torch.randint(0, L + 1, (), generator=gen)) for L in lens]
        for pool in (plain, folded):
            commit(pool, md, i32(n, device))
        for s, c in zip(order, n):
            if s >= 0:
                done[s] += c
    folded.flush()
    for a, b in zip(pool_states(folded), pool_states(plain)):
        assert same_bits(a, b)


def test_folded_pool_requires_a_flush_for_slots_a_step_skips(device):
    from ssm_spec import RecoverSSMMetadata, commit
    layers, (_, folded) = _pair(device)
    md = RecoverSSMMetadata.build([3, 2], [False, False], [8, 12], [4, 1], num_slots=6, device=device)
    run_stack(layers, torch.randn(5, 32).to(device), md, folded)
    commit(folded, md, i32([2, 1], device))  # slots 4 and 1 now pending
    md1 = RecoverSSMMetadata.build([2], [False], [10], [4], num_slots=6, device=device)
    run_stack(layers, torch.randn(2, 32).to(device), md1, folded)  # slot 1 skipped
    with pytest.raises(ValueError, match=r"slots \[1\] have pending windows"):
        commit(folded, md1, i32([1], device))
    folded.flush([1])
    commit(folded, md1, i32([1], device))
    prefill = RecoverSSMMetadata.build([4], [True], [11], [4], num_slots=6, device=device)
    with pytest.raises(ValueError, match="pending window"):
        run_stack(layers, torch.randn(4, 32).to(device), prefill, folded)
    folded.flush([4])
    run_stack(layers, torch.randn(4, 32).to(device), prefill, folded)


def test_folded_pool_rejects_snapshot_and_flush_on_plain_pools(device):
    from ssm_spec import StatePool
    layers = _layers(device)
    with pytest.raises(ValueError, match="choose one"):
        StatePool(layers, num_slots=2, max_tokens=4, device=device, snapshot=True, folded=True)
    with pytest.raises(ValueError, match="folded pool"):
        StatePool(layers, num_slots=2, max_tokens=4, device=device).flush()


def _step(layers, pools, order, lens, done, n, device, gen, prefill=None, validate=True):
    """One step on every pool (same inputs): forward, then commit ``n``; returns the outputs."""
    from ssm_spec import RecoverSSMMetadata, commit
    pre = prefill or [False] * len(order)
    md = RecoverSSMMetadata.build(lens, pre, [done.get(s, 0) for s in order], order, num_slots=6, device=device)
    x = torch.randn(sum(lens), 32, generator=gen).to(device)
    outs = [run_stack(layers, x, md, pool) for pool in pools]
    for pool in pools:
        commit(pool, md, i32(n, device), validate=validate)
    for s, c, L, p in zip(order, n, lens, pre):
        done[s] = done.get(s, 0) + (L if p else c)
    return outs


def _same_states(a, b):
    return all(same_bits(x, y) for x, y in zip(pool_states(a), pool_states(b)))


def test_flush_is_safe_mid_step_and_with_repeated_slots(device):
    """flush() between a step's forward and its commit commits only what that step did not
    take over; a slot named twice is committed once."""
    from ssm_spec import RecoverSSMMetadata, commit
    layers, (plain, folded) = _pair(device)
    gen = torch.Generator().manual_seed(5)
    done = {4: 8, 1: 12}
    _step(layers, (plain, folded), [4, 1], [3, 2], done, [2, 1], device, gen)
    md = RecoverSSMMetadata.build([4], [False], [done[4]], [4], num_slots=6, device=device)
    x = torch.randn(4, 32, generator=gen).to(device)
    assert same_bits(run_stack(layers, x, md, folded), run_stack(layers, x, md, plain))
    folded.flush()  # slot 1 (not in this step) is committed; slot 4's window went to the verify
    folded.flush([1, 1])
    for pool in (plain, folded):
        commit(pool, md, i32([3], device))
    folded.flush([4, 4])
    assert _same_states(folded, plain)


def test_a_refused_prefill_writes_nothing_and_the_retry_is_exact(device):
    layers, (plain, folded) = _pair(device)
    gen = torch.Generator().manual_seed(6)
    done = {4: 8, 1: 12}
    _step(layers, (plain, folded), [4, 1], [3, 2], done, [2, 2], device, gen)
    before = [t.clone() for t in pool_states(folded)]
    with pytest.raises(ValueError, match="pending window"):  # slot 1 continues its prefill
        _step(layers, (folded,), [4, 1], [2, 3], dict(done), [1, 0], device, torch.Generator().manual_seed(7),
              prefill=[False, True])
    assert all(same_bits(a, b) for a, b in zip(pool_states(folded), before))  # conv states included
    folded.flush([1])
    _step(layers, (plain, folded), [4, 1], [2, 3], done, [1, 0], device, torch.Generator().manual_seed(7),
          prefill=[False, True])
    folded.flush()
    assert _same_states(folded, plain)


@pytest.mark.parametrize("fresh", ["prefill", "verify"])
def test_a_fresh_request_drops_the_window_its_slot_had_pending(device, fresh):
    """A request finishes on slot 1 without a flush and unvalidated commits (no host checks),
    then a new request takes slot 1 (a prefill from zeros, or a verify from zeros): the old
    window is never committed onto the new state."""
    layers, (plain, folded) = _pair(device)
    gen = torch.Generator().manual_seed(8)
    done = {4: 8, 1: 12}
    _step(layers, (plain, folded), [4, 1], [3, 3], done, [2, 3], device, gen, validate=False)
    done[1] = 0  # slot 1 now belongs to a new request
    if fresh == "prefill":
        _step(layers, (plain, folded), [4, 1], [2, 5], done, [2, 0], device, gen, prefill=[False, True],
              validate=False)
    else:
        _step(layers, (plain, folded), [4, 1], [2, 3], done, [2, 2], device, gen, validate=False)
    _step(layers, (plain, folded), [1, 4], [3, 2], done, [3, 1], device, gen, validate=False)
    folded.flush()
    assert _same_states(folded, plain)


def test_discard_drops_a_pending_window(device):
    layers, (plain, folded) = _pair(device)
    before = [t.clone() for t in pool_states(folded)]
    gen = torch.Generator().manual_seed(9)
    _step(layers, (folded,), [4, 1], [3, 3], {4: 8, 1: 12}, [2, 3], device, gen)
    folded.discard([1, 4])
    folded.flush()
    gdn_now, gdn_before = pool_states(folded)[0], before[0]
    assert same_bits(gdn_now[:, [1, 4]], gdn_before[:, [1, 4]])  # the recurrent states: never committed
    for bad in ([6], [-1]):
        with pytest.raises(ValueError, match="discard"):
            folded.discard(bad)
