"""Fast mode through the pool, the modules and commit (docs/design.md section 2.6), and its
exactness contract: window outputs within 4x the exact kernel's own error against float64,
states over 1,000 steps within 2x (no drift)."""

import statistics

import pytest
import torch

from ssm_spec import ops, reference
from tests.helpers import (
    gdn_inputs,
    i32,
    pool_states,
    qsl_from_lengths,
    random_pool,
    randomize_,
    rel_err,
    run_stack,
)

NAN = float("nan")


def _layers(device, seed=0):
    from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv
    torch.manual_seed(seed)
    layers = [RecoverGatedDeltaNet(32, 2, 4, 16, 16, device=device), RecoverShortConv(32, 3, dilation=2, device=device),
              RecoverGatedDeltaNet(32, 2, 4, 16, 16, device=device)]
    return randomize_(layers, 0.3)


POOLS = {"exact": {}, "fast": dict(mode="fast"), "fast_folded": dict(mode="fast", folded=True),
         "lazy4": dict(mode="fast", folded=True, max_pending=4), "lazy16": dict(mode="fast", folded=True, max_pending=16)}


def _pools(device, names, dtype=torch.float32):
    from ssm_spec import RecoverSSMMetadata, StatePool
    layers = _layers(device)
    pools = {n: StatePool(layers, num_slots=6, max_tokens=16, dtype=dtype, device=device, max_window=4, **POOLS[n])
             for n in names}
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(1)).to(device)
    md = RecoverSSMMetadata.build([8, 12], [True, True], [0, 0], [4, 1], num_slots=6, device=device)
    for pool in pools.values():
        run_stack(layers, x, md, pool)
    return layers, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_pools_decode_like_the_exact_pool(device, dtype):
    """40 steps with ragged windows, counts 0..W, a padding row, reordered rows, a slot left out
    of some steps (its pending tokens stay in the lazy rings) and a prefill continuing a slot (the
    lazy pool flushes it first): every fast pool's outputs stay near the exact pool's, and after a
    flush so do the states."""
    from ssm_spec import NULL_SLOT, RecoverSSMMetadata, commit
    layers, pools = _pools(device, list(POOLS), dtype)
    gen = torch.Generator().manual_seed(2)
    done = {4: 8, 1: 12, 0: 0}
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for step in range(40):
        order = [4, 1] if step % 3 else [1, NULL_SLOT, 4]
        if step % 7 == 5:
            order = [4]  # slot 1 sits out: its pending tokens must survive the step
        prefill = [False] * len(order)
        lens = [0 if s < 0 else int(torch.randint(1, 5, (), generator=gen)) for s in order]
        if step == 20:  # slot 1 continues with a prefill chunk
            order, prefill, lens = [4, 1], [False, True], [3, 5]
        md = RecoverSSMMetadata.build(lens, prefill, [done.get(s, 0) for s in order], order, num_slots=6,
                                      device=device)
        x = torch.randn(sum(lens), 32, generator=gen).to(device)
        ys = {n: run_stack(layers, x, md, pool) for n, pool in pools.items()}
        for n, y in ys.items():
            assert rel_err(y.double(), ys["exact"].double()) < tol, (n, step)
        counts = [L if p else int(torch.randint(0, L + 1, (), generator=gen)) for L, p in zip(lens, prefill)]
        for pool in pools.values():
            commit(pool, md, i32(counts, device))
        for s, c in zip(order, counts):
            if s >= 0:
                done[s] = done.get(s, 0) + c
    for n, pool in pools.items():
        if pool.folded:
            pool.flush()
        for a, b in zip(pool_states(pool), pool_states(pools["exact"])):
            assert rel_err(a.double(), b.double()) < tol, n


def test_flush_mid_step_and_discard_in_lazy_mode(device):
    """flush() between a step's forward and its commit folds only the tokens that verify did not
    (the commit then adds the accepted ones after them); discard drops pending tokens."""
    from ssm_spec import RecoverSSMMetadata, commit
    layers, pools = _pools(device, ["exact", "lazy16"])
    exact, lazy = pools["exact"], pools["lazy16"]
    gen = torch.Generator().manual_seed(5)
    done = {4: 8, 1: 12}
    for step in range(3):
        md = RecoverSSMMetadata.build([3, 2], [False, False], [done[4], done[1]], [4, 1], num_slots=6, device=device)
        x = torch.randn(5, 32, generator=gen).to(device)
        for pool in (exact, lazy):
            run_stack(layers, x, md, pool)
        if step == 1:
            lazy.flush()
            lazy.flush([1, 1])
        for pool in (exact, lazy):
            commit(pool, md, i32([2, 1], device))
        done[4] += 2
        done[1] += 1
    lazy.flush([4, 4])
    lazy.flush()
    for a, b in zip(pool_states(lazy), pool_states(exact)):
        assert rel_err(a.double(), b.double()) < 2e-4
    before = pool_states(lazy)
    md = RecoverSSMMetadata.build([3], [False], [done[4]], [4], num_slots=6, device=device)
    run_stack(layers, torch.randn(3, 32, generator=gen).to(device), md, lazy)
    commit(lazy, md, i32([3], device))
    lazy.discard([4])
    lazy.flush()
    assert torch.equal(pool_states(lazy)[0][:, 4], before[0][:, 4])  # the recurrent state: never committed


def test_pool_arguments(device):
    from ssm_spec import StatePool
    layers = _layers(device)
    mk = lambda **kw: StatePool(layers, num_slots=2, max_tokens=8, device=device, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="mode"):
        mk(mode="quick")
    with pytest.raises(ValueError, match="max_pending > 1"):
        mk(folded=True, max_pending=4)
    with pytest.raises(ValueError, match="max_pending > 1"):
        mk(mode="fast", max_pending=4)
    with pytest.raises(ValueError, match="max_pending"):
        mk(mode="fast", folded=True, max_pending=0)
    with pytest.raises(ValueError, match="snapshot"):
        mk(mode="fast", snapshot=True)
    with pytest.raises(ValueError, match="max_window"):
        mk(mode="fast", folded=True, max_window=9)
    pool = mk(mode="fast", folded=True, max_pending=16, max_window=4)
    assert pool.ring_positions == 20 and not pool.double_buffered
    per_token = (4 * 16 + 2 * 16 + 4) * 4
    assert pool.ring_bytes_per_slot() == 2 * 20 * per_token  # two GDN layers
    assert mk(folded=True).double_buffered and mk(mode="fast").mode == "fast"


# ----------------------------------------------------------------------------- the contract


def _windows(n, seed, device):
    """``n`` random windows of 1..8 tokens over small heads, a tenth with extreme gates
    (g = -60: the checkpoint decays away; g = 0: no decay)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 9, (n,), generator=gen)]
    HV, H, K, V = 2, 1, 16, 16
    qsl = qsl_from_lengths(lengths, device)
    T = int(qsl[-1])
    inp = gdn_inputs(T, H, HV, K, V, device, gen=gen)
    g = inp.g.clone()
    for b in range(0, n, 10):
        g[int(qsl[b]):int(qsl[b + 1])] = -60.0 if b % 20 == 0 else 0.0
    inp.g = g.to(device)
    pool = random_pool(n, HV, K, V, device, gen=gen)
    return inp, pool, qsl, lengths


def test_contract_window_outputs_within_4x_the_exact_kernels_error(device):
    """>= 1,000 random windows (extreme gates included): the closed-form verify's relative error
    against the float64 token loop is at most 4x the exact verify's own, in median and maximum."""
    n = 1000
    inp, pool, qsl, lengths = _windows(n, 11, device)
    src = torch.arange(n, dtype=torch.int32, device=device)
    out_exact, _ = ops.gdn_verify(*inp.args(), pool, src, qsl)
    out_fast, _ = ops.gdn_closed_form_verify(*inp.args(), pool, src, qsl, max_window=8)
    e_exact, e_fast = [], []
    qs = qsl.tolist()
    cpu = [x.cpu() for x in inp.args()]
    for b in range(n):
        w = slice(qs[b], qs[b + 1])
        ref = reference.gdn_native_step(*(x[w] for x in cpu), pool[b].cpu(), dtype=torch.float64).out
        e_exact.append(rel_err(out_exact[w].cpu().double(), ref))
        e_fast.append(rel_err(out_fast[w].cpu().double(), ref))
    med = (statistics.median(e_exact), statistics.median(e_fast))
    print(f"window rel err vs float64: exact median {med[0]:.3g} max {max(e_exact):.3g}; "
          f"fast median {med[1]:.3g} max {max(e_fast):.3g}")
    assert med[1] <= 4 * med[0] and max(e_fast) <= 4 * max(e_exact)


def _decode(device, steps, mode, L=1, seed=0):
    """``steps`` decode steps over 2 rows with random accepted counts: the exact path (verify +
    commit), fast (closed-form verify + commit) or lazy (the folded closed form, ``L``); returns
    the state's relative error against a float64 token loop of the accepted tokens every 50
    steps (the lazy pool flushed there: what reading a state takes)."""
    from ssm_spec.ops.gdn.closed_form import RecordRing, ring_positions
    gen = torch.Generator().manual_seed(seed)
    HV, H, K, V, W, B = 2, 1, 16, 16, 4, 2
    slots = i32([0, 1], device)
    pool = random_pool(2, HV, K, V, device, gen=gen)
    ref = {s: pool[s].cpu().double() for s in range(B)}
    qsl = qsl_from_lengths([W] * B, device)
    R = ring_positions(L, W)
    ring = RecordRing.zeros(2, R, H, HV, K, V, device)
    start = torch.zeros(B, dtype=torch.int32, device=device)
    count = torch.zeros(B, dtype=torch.int32, device=device)
    errs = []
    for step in range(steps):
        inp = gdn_inputs(B * W, H, HV, K, V, device, gen=gen)
        n = torch.randint(0, W + 1, (B,), generator=gen)
        if mode == "exact":
            _, rec = ops.gdn_verify(*inp.args(), pool, slots, qsl)
            ops.gdn_commit(pool, rec, qsl, slots, n.to(device=device, dtype=torch.int32))
        elif mode == "fast":
            _, rec = ops.gdn_closed_form_verify(*inp.args(), pool, slots, qsl, max_window=W)
            ops.gdn_commit(pool, rec, qsl, slots, n.to(device=device, dtype=torch.int32))
        else:
            ops.gdn_closed_form_folded_verify(*inp.args(), pool, slots, qsl, ring, start, count, L, max_window=W)
            folded = (count > 0) & (count + W > L)
            start = torch.where(folded, (start + count) % R, start)
            count = torch.where(folded, 0, count) + n.to(device=device, dtype=torch.int32)
        for b in range(B):
            if n[b] > 0:
                res = reference.gdn_native_step(*(x.cpu()[b * W:b * W + int(n[b])] for x in inp.args()), ref[b],
                                                dtype=torch.float64, keep_states=False)
                ref[b] = res.states[-1]
        if step % 50 == 49:
            if mode == "lazy":  # a flush (what reading a state takes)
                e = gdn_inputs(0, H, HV, K, V, device)
                ops.gdn_closed_form_folded_verify(*e.args(), pool, slots, torch.zeros(B + 1, dtype=torch.int32,
                                                                                       device=device),
                                                  ring, start, count, 0, max_window=0)
                start, count = (start + count) % R, torch.zeros_like(count)
            errs.append(max(rel_err(pool[b].cpu().double(), ref[b]) for b in range(B)))
    return errs


def test_contract_states_over_1000_steps_within_2x_the_exact_path(device):
    """1,000 steps of random accepted counts: the state's error against float64 stays within 2x
    the exact path's own (fast with commit, and the lazy commit with L = 16): no drift."""
    steps = 1000
    exact = _decode(device, steps, "exact")
    fast = _decode(device, steps, "fast")
    lazy = _decode(device, steps, "lazy", L=16)
    print(f"state rel err vs float64 (every 50 of {steps} steps): exact max {max(exact):.3g} last {exact[-1]:.3g}; "
          f"fast max {max(fast):.3g} last {fast[-1]:.3g}; lazy L=16 max {max(lazy):.3g} last {lazy[-1]:.3g}")
    assert len(exact) == steps // 50
    assert max(fast) <= 2 * max(exact) and max(lazy) <= 2 * max(exact)


@pytest.mark.parametrize("name", ["folded_exact", "fast_folded", "lazy2", "lazy16"])
def test_a_step_of_empty_windows_keeps_what_is_pending(device, name):
    """A step whose verify rows all have empty windows runs no kernel: the pending tokens of
    every folded pool survive it (found by a review: they were handed to a verify that never
    ran), as does a discard between a forward and its commit (the lazy ring moves past the
    dropped tokens, the window verified stays the commit's)."""
    from ssm_spec import RecoverGatedDeltaNet, RecoverSSMMetadata, StatePool, commit
    torch.manual_seed(0)
    layer = randomize_([RecoverGatedDeltaNet(32, 2, 4, 16, 16, device=device)], 0.3)[0]
    kw = {"folded_exact": dict(folded=True), "fast_folded": dict(mode="fast", folded=True),
          "lazy2": dict(mode="fast", folded=True, max_pending=2), "lazy16": dict(mode="fast", folded=True,
                                                                                   max_pending=16)}[name]
    pools = [StatePool([layer], num_slots=2, max_tokens=8, device=device, max_window=4, **k) for k in ({}, kw)]
    gen = torch.Generator().manual_seed(1)

    def step(lens, prefill, done, n):
        md = RecoverSSMMetadata.build(lens, prefill, done, [0] * len(lens), num_slots=2, device=device)
        x = torch.randn(sum(lens), 32, generator=gen).to(device)
        with torch.no_grad():
            ys = [layer(x, md, pool) for pool in pools]
        for pool in pools:
            commit(pool, md, i32(n, device))
        return ys

    step([4], [True], [0], [4])
    step([3], [False], [4], [3])
    step([0], [False], [7], [0])  # an empty window
    ys = step([2], [False], [7], [2])
    assert rel_err(ys[1].double(), ys[0].double()) < 1e-4
    pools[1].flush()
    assert rel_err(pools[1].gdn_state(layer).double(), pools[0].gdn_state(layer).double()) < 1e-4


def test_discard_mid_step_matches_the_exact_folded_pool(device):
    """A discard between a step's forward and its commit leaves the slots that step verified as
    they are in both folded pools (found by a review: the lazy pool's commit then pointed at
    dropped records). (After a commit a discard drops whatever is pending, which in a lazy pool is
    more than the exact folded pool's last window: discard is for slots whose state is not kept.)"""
    from ssm_spec import RecoverGatedDeltaNet, RecoverSSMMetadata, StatePool, commit
    torch.manual_seed(0)
    layer = randomize_([RecoverGatedDeltaNet(32, 2, 4, 16, 16, device=device)], 0.3)[0]
    pools = [StatePool([layer], num_slots=2, max_tokens=8, device=device, folded=True),
             StatePool([layer], num_slots=2, max_tokens=8, device=device, mode="fast", folded=True, max_pending=16,
                       max_window=4)]
    gen = torch.Generator().manual_seed(2)
    done = 0
    for lens, pre, n, drop in (([4], True, 4, None), ([3], False, 2, None), ([3], False, 3, "mid"),
                               ([2], False, 2, None), ([3], False, 1, None)):
        md = RecoverSSMMetadata.build(lens, [pre], [done], [0], num_slots=2, device=device)
        x = torch.randn(sum(lens), 32, generator=gen).to(device)
        with torch.no_grad():
            ys = [layer(x, md, pool) for pool in pools]
        assert rel_err(ys[1].double(), ys[0].double()) < 1e-4
        for pool in pools:
            if drop == "mid":
                pool.discard([0])
            commit(pool, md, i32([n], device))
        done += n
    for pool in pools:
        pool.flush()
    assert rel_err(pools[1].gdn_state(layer).double(), pools[0].gdn_state(layer).double()) < 1e-4
    with pytest.raises(ValueError, match="ints"):
        pools[1].flush([1.7])
    with pytest.raises(ValueError, match="folded pool"):
        StatePool([layer], num_slots=2, max_tokens=8, device=device).discard()
