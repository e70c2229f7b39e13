"""Property-based checks of verify + commit on the CPU kernels against the reference."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssm_spec import ops, reference
from tests.helpers import gdn_inputs, i32, qsl_from_lengths, same_bits


@st.composite
def steps(draw):
    """A batch: ragged windows (empty ones included), distinct slots or padding, counts."""
    H = draw(st.integers(1, 2))
    HV = H * draw(st.sampled_from([1, 2, 3]))
    K = draw(st.integers(1, 9))
    V = draw(st.integers(1, 7))
    B = draw(st.integers(0, 4))
    lengths = draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))
    S = B + draw(st.integers(1, 3))
    slots = draw(st.permutations(range(S)))[:B]
    srcs = [s if draw(st.booleans()) or s % 2 else -1 for s in slots]  # some padding rows
    counts = [draw(st.integers(0, n)) for n in lengths]
    in_place = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return H, HV, K, V, lengths, S, srcs, counts, in_place, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_gdn_verify_commit_is_the_reference_state(step):
    H, HV, K, V, lengths, S, srcs, counts, in_place, seed = step
    gen = torch.Generator().manual_seed(seed)
    qsl = qsl_from_lengths(lengths, "cpu")
    inp = gdn_inputs(int(qsl[-1]), H, HV, K, V, "cpu", gen=gen)
    pool = torch.randn(S, HV, K, V, generator=gen)
    src = i32(srcs, "cpu")
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    # dst: in place, or the (free) slots beyond the sources
    free = [s for s in range(S) if s not in srcs]
    dsts = srcs if in_place else [free[b % len(free)] if b < len(free) else -1 for b in range(len(srcs))]
    work = pool.clone()
    ops.gdn_commit(work, rec, qsl, src, i32(counts, "cpu"), i32(dsts, "cpu"))
    written = set()
    for b, (s, n, d) in enumerate(zip(srcs, counts, dsts)):
        if s < 0 or n == 0 or d < 0:
            continue
        bos = int(qsl[b])
        ref = reference.gdn_native_step(*inp.window(bos, bos + n), pool[s], dtype=torch.float32)
        assert torch.equal(work[d], ref.states[-1])
        written.add(d)
    for slot in range(S):
        if slot not in written:
            assert same_bits(work[slot], pool[slot])


@settings(max_examples=150, deadline=None)
@given(steps(), st.integers(2, 4), st.integers(1, 4))
def test_short_conv_commit_is_the_last_inputs(step, ks, dil):
    _, _, C, _, lengths, S, srcs, counts, in_place, seed = step
    gen = torch.Generator().manual_seed(seed)
    lc = (ks - 1) * dil
    qsl = qsl_from_lengths(lengths, "cpu")
    x = torch.randn(int(qsl[-1]), C, generator=gen)
    state = torch.randn(S, lc, C, generator=gen)
    w = torch.randn(C, ks, generator=gen)
    src = i32(srcs, "cpu")
    out, rec_x = ops.short_conv_verify(x, w, None, state, src, qsl, dilation=dil)
    work = state.clone()
    ops.short_conv_commit(work, rec_x, qsl, src, i32(counts, "cpu"))
    for b, (s, n) in enumerate(zip(srcs, counts)):
        if s < 0:
            continue
        bos = int(qsl[b])
        if lengths[b]:
            ref = reference.short_conv_native_step(x[bos:bos + lengths[b]], w, None, state[s], dil,
                                                   dtype=torch.float64)
            assert torch.allclose(out[bos:bos + lengths[b]].double(), ref.out, rtol=1e-5, atol=1e-6)
        expected = torch.cat([state[s], x[bos:bos + n]])[n:n + lc]
        assert torch.equal(work[s], expected)
