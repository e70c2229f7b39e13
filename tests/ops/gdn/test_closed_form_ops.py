"""Fast mode's ops: ``gdn_closed_form_verify`` and the lazy ``gdn_closed_form_folded_verify``
against the float64 oracles (docs/design.md section 2.6), on the CPU and the GPU."""

import pytest
import torch

from ssm_spec import ops, reference
from ssm_spec.ops.gdn.closed_form import RecordRing
from ssm_spec.reference_closed_form import gdn_closed_form_step
from tests.helpers import gdn_inputs, i32, qsl_from_lengths, random_pool, rel_err

NAN = float("nan")
HV, H, K, V = 4, 2, 16, 24


def _f64_rows(inp, pool, src, qsl, scale=None):
    """The float64 token loop per row: ``(out [T, HV, V], final states {slot: [HV, K, V]})``."""
    out = torch.full((inp.q.shape[0], HV, V), NAN, dtype=torch.float64)
    finals = {}
    qs = qsl.tolist()
    for b, slot in enumerate(src.tolist()):
        bos, eos = qs[b], qs[b + 1]
        if slot < 0 or eos == bos:
            continue
        res = reference.gdn_native_step(*(x.cpu() for x in inp.window(bos, eos)), pool[slot].cpu(), scale=scale,
                                        dtype=torch.float64)
        out[bos:eos] = res.out
        finals[slot] = res.states[-1]
    return out, finals


@pytest.mark.parametrize("gates", ["random", "strong", "none"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_closed_form_verify_against_float64(device, gates, state_dtype):
    """Outputs near the float64 token loop; the record commits (gdn_commit) to a state near the
    float64 final state; padding rows and tokens outside windows untouched; the pool read only."""
    lengths = [3, 0, 4, 1, 2]
    qsl = qsl_from_lengths(lengths, device)
    src = i32([0, 2, -1, 5, 6], device)
    T = int(qsl[-1]) + 2  # trailing tokens outside every window
    gen = torch.Generator().manual_seed(7)
    g_fill = {"random": None, "strong": -60.0, "none": 0.0}[gates]
    inp = gdn_inputs(T, H, HV, K, V, device, gen=gen, g_fill=g_fill)
    pool = random_pool(8, HV, K, V, device, dtype=state_dtype, gen=gen)
    before = pool.clone()
    out, rec = ops.gdn_closed_form_verify(*inp.args(), pool, src, qsl, max_window=4)
    assert torch.equal(pool, before)
    ref_out, finals = _f64_rows(inp, pool.double(), src, qsl)
    live = ~torch.isnan(ref_out)
    assert rel_err(out.cpu().double()[live], ref_out[live]) < 2e-5
    n = i32(lengths, device)
    ops.gdn_commit(pool, rec, qsl, src, n)
    for slot, final in finals.items():
        tol = 2e-5 if state_dtype == torch.float32 else 1e-2
        assert rel_err(pool[slot].cpu().double(), final) < tol
    for slot in (1, 3, 4, 7):  # no row's slot
        assert torch.equal(pool[slot], before[slot])


def _ring_run(device, L, steps, state_dtype=torch.float32, W=4, seed=0):
    """A decode of ``steps`` steps with random accepted counts through the lazy verify and the
    pool-side pending bookkeeping, beside a float64 token loop of the accepted tokens."""
    gen = torch.Generator().manual_seed(seed)
    B, S = 3, 5
    slots = i32([4, 0, 2], device)
    R = max(L, W) + W
    pool = random_pool(S, HV, K, V, device, dtype=state_dtype, gen=gen)
    ring = RecordRing(*(torch.full_like(x, NAN) for x in RecordRing.zeros(S, R, H, HV, K, V, device)))
    ref = {s: pool[s].cpu().double() for s in slots.tolist()}
    start = torch.zeros(B, dtype=torch.int32, device=device)
    count = torch.zeros(B, dtype=torch.int32, device=device)
    qsl = qsl_from_lengths([W] * B, device)
    errs = []
    for step in range(steps):
        inp = gdn_inputs(B * W, H, HV, K, V, device, gen=gen)
        out = ops.gdn_closed_form_folded_verify(*inp.args(), pool, slots, qsl, ring, start, count, L, max_window=W)
        n = torch.randint(0, W + 1, (B,), generator=gen)
        for b, s in enumerate(slots.tolist()):
            res = reference.gdn_native_step(*(x.cpu() for x in inp.window(b * W, b * W + W)), ref[s],
                                            dtype=torch.float64)
            errs.append(rel_err(out[b * W:(b + 1) * W].cpu().double(), res.out))
            if n[b] > 0:
                ref[s] = res.states[int(n[b]) - 1]
        # the pool's bookkeeping (StatePool does this on the device): a row that folded starts
        # after its old pending tokens; the accepted tokens join the pending ones
        folded = (count > 0) & (count + W > L)
        start = torch.where(folded, (start + count) % R, start)
        count = torch.where(folded, 0, count) + n.to(device=device, dtype=torch.int32)
    # a flush: fold everything still pending
    empty = gdn_inputs(0, H, HV, K, V, device)
    ops.gdn_closed_form_folded_verify(*empty.args(), pool, slots, torch.zeros(B + 1, dtype=torch.int32, device=device),
                                      ring, start, count, 0, max_window=0)
    state_errs = [rel_err(pool[s].cpu().double(), ref[s]) for s in slots.tolist()]
    return max(errs), max(state_errs)


@pytest.mark.parametrize("L", [1, 4, 16])
def test_lazy_verify_tracks_the_float64_decode(device, L):
    out_err, state_err = _ring_run(device, L, steps=24)
    assert out_err < 5e-5 and state_err < 5e-5


def test_lazy_verify_bf16_state(device):
    out_err, state_err = _ring_run(device, 16, steps=12, state_dtype=torch.bfloat16)
    assert out_err < 2e-2 and state_err < 2e-2


def test_fold_writes_only_folding_rows_and_ring_outside_pending_stays(device):
    """A row with pending tokens under the bound reads its state only; the fold rule is
    ``count > 0 and count + W > max_pending``; ring positions outside the window stay."""
    gen = torch.Generator().manual_seed(3)
    W, L, S = 2, 4, 4
    R = L + W
    pool = random_pool(S, HV, K, V, device, gen=gen)
    ring = RecordRing(*(torch.randn_like(x) for x in RecordRing.zeros(S, R, H, HV, K, V, device)))
    ring = RecordRing(ring.u, ring.k, -ring.g.abs())
    slots = i32([0, 1, 2], device)
    start, count = i32([1, 5, 0], device), i32([2, 3, 0], device)  # 2+2<=4: history; 3+2>4: fold; 0: nothing
    inp = gdn_inputs(3 * W, H, HV, K, V, device, gen=gen)
    before, ring_before = pool.clone(), RecordRing(*(x.clone() for x in ring))
    ops.gdn_closed_form_folded_verify(*inp.args(), pool, slots, qsl_from_lengths([W] * 3, device), ring, start, count,
                                      L, max_window=W)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2]) and torch.equal(pool[3], before[3])
    assert not torch.equal(pool[1], before[1])
    written = {0: {3, 4}, 1: {2, 3}, 2: {0, 1}}  # (start + count + t) % R
    for s, pos in written.items():
        for p in range(R):
            same = torch.equal(ring.u[s, p], ring_before.u[s, p])
            assert same != (p in pos), (s, p)
    assert torch.equal(ring.u[3], ring_before.u[3])


def test_closed_form_malformed_inputs_raise_and_write_nothing(device):
    qsl = qsl_from_lengths([3, 2], device)
    inp = gdn_inputs(5, H, HV, K, V, device)
    pool = random_pool(4, HV, K, V, device)
    before = pool.clone()
    with pytest.raises(ValueError, match="max_window"):
        ops.gdn_closed_form_verify(*inp.args(), pool, i32([0, 1], device), qsl, max_window=2)
    with pytest.raises(ValueError, match="state_indices"):
        ops.gdn_closed_form_verify(*inp.args(), pool, i32([0, 9], device), qsl)
    ring = RecordRing.zeros(4, 4, H, HV, K, V, device)
    with pytest.raises(ValueError, match=r"ring\.u"):  # the caller passed ring; 4 positions < max(1, 3) + 3
        ops.gdn_closed_form_folded_verify(*inp.args(), pool, i32([0, 1], device), qsl, ring, i32([0, 0], device),
                                          i32([0, 0], device), 1, max_window=3)
    ring = RecordRing.zeros(4, 8, H, HV, K, V, device)
    with pytest.raises(ValueError, match="pending_start"):
        ops.gdn_closed_form_folded_verify(*inp.args(), pool, i32([0, 1], device), qsl, ring, i32([0, 9], device),
                                          i32([0, 0], device), 1)
    with pytest.raises(ValueError, match="state_indices"):
        ops.gdn_closed_form_folded_verify(*inp.args(), pool, i32([1, 1], device), qsl, ring, i32([0, 0], device),
                                          i32([1, 0], device), 1)
    assert torch.equal(pool, before)


def test_closed_form_opcheck_and_compile(device):
    qsl = qsl_from_lengths([3, 0, 2], device)
    src = i32([0, -1, 3], device)
    inp = gdn_inputs(6, H, HV, K, V, device)
    pool = random_pool(5, HV, K, V, device)
    T = 6
    bufs = (torch.zeros(T, HV, V, device=device), torch.zeros(T, HV, V, device=device),
            torch.zeros(T, H, K, device=device), torch.zeros(T, HV, device=device))
    torch.library.opcheck(torch.ops.ssm_spec.gdn_closed_form_verify.default,
                          (*inp.args(), pool, src, qsl, *bufs, 3, K**-0.5, True))
    ring = RecordRing(*(torch.randn_like(x) for x in RecordRing.zeros(5, 7, H, HV, K, V, device)))
    ring = RecordRing(ring.u, ring.k, -ring.g.abs())
    torch.library.opcheck(torch.ops.ssm_spec.gdn_closed_form_folded_verify.default,
                          (*inp.args(), pool.clone(), src, qsl, bufs[0], *ring, i32([1, 0, 2], device),
                           i32([2, 0, 1], device), 3, 2, K**-0.5, True))

    def step(q, k, v, g, beta, state, ring_u, ring_k, ring_g, start, count):
        out = ops.gdn_closed_form_folded_verify(q, k, v, g, beta, state, src, qsl, (ring_u, ring_k, ring_g), start,
                                                count, 2, max_window=3)
        o2, rec = ops.gdn_closed_form_verify(q, k, v, g, beta, state, src, qsl, max_window=3)
        return out, o2, rec.u

    args = (*inp.args(), None, *ring, i32([1, 0, 2], device), i32([2, 0, 1], device))
    p_eager, p_comp = pool.clone(), pool.clone()
    r_eager = [x.clone() for x in ring]
    r_comp = [x.clone() for x in ring]
    eager = step(*args[:5], p_eager, *r_eager, *args[9:])
    compiled = torch.compile(step, fullgraph=True)(*args[:5], p_comp, *r_comp, *args[9:])
    for a, b in zip(eager, compiled):
        assert torch.equal(a[:5], b[:5])  # token 5 lies outside every window
    assert torch.equal(p_eager, p_comp)
    assert all(torch.equal(a, b) for a, b in zip(r_eager, r_comp))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_closed_form_bits_do_not_depend_on_the_tile_on_gpu():
    """Every sum has an order of the code's (key-order FMA chains, kdot, token-order chains):
    tiles change speed only. The ring forms at L=4 (a fold of at most 4 records: one block) and
    L=16 (more than 4 pending: the per-record fold loop, and the history path), the table's tile
    (128/1) included."""
    from ssm_spec.ops.gdn.closed_form import launch_closed_form, ring_positions

    dev = torch.device("cuda")
    Hq, HVq, Kq, Vq = 16, 32, 128, 128
    lengths = [4, 3, 0, 4, 1, 4, 2, 4]
    qsl = qsl_from_lengths(lengths, dev)
    src = i32([0, 1, 2, -1, 4, 5, 6, 7], dev)
    inp = gdn_inputs(int(qsl[-1]), Hq, HVq, Kq, Vq, dev, gen=torch.Generator().manual_seed(5))
    pool = random_pool(8, HVq, Kq, Vq, dev)
    rings = {}
    for L, count in ((4, [3, 1, 4, 0, 2, 0, 4, 1]), (16, [13, 5, 16, 0, 9, 12, 16, 3])):
        R = ring_positions(L, 4)
        ring = RecordRing(*(torch.randn_like(x) for x in RecordRing.zeros(8, R, Hq, HVq, Kq, Vq, dev)))
        ring = RecordRing(ring.u, ring.k / ring.k.norm(dim=-1, keepdim=True), -ring.g.abs())
        rings[L] = (ring, i32([0, 3, 1, 0, R - 1, 2, 0, 5], dev), i32(count, dev))
    results = []
    for tile in ((128, 8, 1), (128, 16, 1), (128, 32, 1), (128, 32, 2), (128, 64, 4), (128, 128, 1)):
        T = inp.q.shape[0]
        out = torch.full((T, HVq, Vq), NAN, device=dev)
        rec = (torch.full((T, HVq, Vq), NAN, device=dev), torch.full((T, Hq, Kq), NAN, device=dev),
               torch.full((T, HVq), NAN, device=dev))
        launch_closed_form(*inp.args(), pool, src, qsl, out, rec, 4, Kq**-0.5, True, config=tile)
        got = [out, *rec]
        for L, (base_ring, start, count) in rings.items():
            p2, r2, o2 = pool.clone(), RecordRing(*(x.clone() for x in base_ring)), torch.full_like(out, NAN)
            launch_closed_form(*inp.args(), p2, src, qsl, o2, r2, 4, Kq**-0.5, True, pending=(start, count, L),
                               config=tile)
            got += [o2, p2, *r2]
        results.append(got)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))
