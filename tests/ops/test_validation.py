"""Malformed inputs raise a ValueError naming the argument and change no state; with
validation off, out-of-range metadata is skipped or clamped, never dereferenced."""

import re

import pytest
import torch

from ssm_spec import ops
from tests.helpers import verified_gdn, fenced, i32, qsl_from_lengths, same_bits

HV, H, K, V, S = 4, 2, 8, 6, 6


@pytest.fixture
def gdn(device):
    return verified_gdn(device, H, HV, K, V, S)


def _verify_kwargs(inp, pool, qsl, src):
    return dict(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta, state=pool, state_indices=src,
                query_start_loc=qsl)


VERIFY_CASES = {
    "g_dtype": ("g", lambda a, d: a.update(g=a["g"].to(torch.bfloat16))),
    "q_head_dim": ("q", lambda a, d: a.update(q=a["q"][..., :-1])),
    "k_shape": ("k", lambda a, d: a.update(k=a["k"][:-1])),
    "v_value_dim": ("v", lambda a, d: a.update(v=a["v"][..., :-1])),
    "beta_shape": ("beta", lambda a, d: a.update(beta=a["beta"][:, :1])),
    "heads_not_divisible": ("q", lambda a, d: a.update(q=a["q"][:, :1].expand(-1, 3, -1), k=a["k"][:, :1].expand(-1, 3, -1))),
    "state_dtype": ("state", lambda a, d: a.update(state=a["state"].half())),
    "state_rank": ("state", lambda a, d: a.update(state=a["state"][0])),
    "index_dtype": ("state_indices", lambda a, d: a.update(state_indices=a["state_indices"].long())),
    "index_len": ("state_indices", lambda a, d: a.update(state_indices=i32([0], d))),
    "slot_range": ("state_indices", lambda a, d: a.update(state_indices=i32([0, S], d))),
    "qsl_decreasing": ("query_start_loc", lambda a, d: a.update(query_start_loc=i32([0, 4, 3], d))),
    "qsl_past_end": ("query_start_loc", lambda a, d: a.update(query_start_loc=i32([0, 3, 7], d))),
    "qsl_negative": ("query_start_loc", lambda a, d: a.update(query_start_loc=i32([-1, 3, 6], d))),
    "qsl_dtype": ("query_start_loc", lambda a, d: a.update(query_start_loc=a["query_start_loc"].long())),
}


@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_gdn_verify_rejects(gdn, device, case):
    inp, pool, qsl, src, _ = gdn
    arg, mutate = VERIFY_CASES[case]
    kwargs = _verify_kwargs(inp, pool, qsl, src)
    mutate(kwargs, device)
    with pytest.raises(ValueError, match=arg):
        ops.gdn_verify(**kwargs)


COMMIT_CASES = {
    "count_too_large": ("num_accepted_tokens", dict(n=[4, 1])),
    "count_negative": ("num_accepted_tokens", dict(n=[1, -1])),
    "dst_range": ("dst_indices", dict(dst=[2, S])),
    "src_range": ("src_indices", dict(src=[0, S + 3])),
    "two_rows_one_slot": ("dst_indices", dict(dst=[3, 3])),
    "writes_other_source": ("dst_indices", dict(dst=[1, 4])),
    "boundary_range": ("boundary_indices", dict(bidx=[[S], [-1]], boff=[[1], [1]])),
    "boundary_conflict": ("boundary_indices", dict(bidx=[[4], [4]], boff=[[1], [2]])),
    "boundary_on_source": ("boundary_indices", dict(bidx=[[-1], [0]], boff=[[1], [1]])),
    "boundary_shape": ("boundary_offsets", dict(bidx=[[2], [3]], boff=[[1, 1], [1, 1]])),
    "count_dtype": ("num_accepted_tokens", dict(n_dtype=torch.int64)),
}


@pytest.mark.parametrize("case", sorted(COMMIT_CASES))
@pytest.mark.parametrize("kind", ["gdn", "short_conv"])
def test_commits_reject_and_change_nothing(gdn, device, case, kind):
    inp, pool, qsl, src, rec = gdn
    arg, spec = COMMIT_CASES[case]
    n = torch.tensor(spec.get("n", [2, 3]), dtype=spec.get("n_dtype", torch.int32), device=device)
    src_ = i32(spec.get("src", [0, 1]), device)
    dst = i32(spec.get("dst", [0, 1]), device)
    bidx = i32(spec.get("bidx", [[-1], [-1]]), device)
    boff = i32(spec.get("boff", [[0], [0]]), device)
    if kind == "gdn":
        state, call = pool, lambda: ops.gdn_commit(pool, rec, qsl, src_, n, dst, bidx, boff)
    else:
        state = torch.randn(S, 3, 5, device=device)
        rec_x = torch.randn(6, 5, device=device)
        call = lambda: ops.short_conv_commit(state, rec_x, qsl, src_, n, dst, bidx, boff)  # noqa: E731
    before = state.clone()
    with pytest.raises(ValueError, match=arg):
        call()
    assert same_bits(state, before), "a rejected call changed the state"


def test_gdn_commit_rejects_record_mismatch(gdn, device):
    inp, pool, qsl, src, rec = gdn
    before = pool.clone()
    n = i32([1, 1], device)
    # the wrapper's caller passed `record`: its fields are named record.u, record.k, record.decay
    bad = [("record.u", rec._replace(u=rec.u[..., :-1])), ("record.k", rec._replace(k=rec.k.double())),
           ("record.decay", rec._replace(decay=rec.decay[:-1])),
           ("record.u", ops.ReplayRecord(*(x.unsqueeze(0) for x in rec)))]  # grouped record, 4-D state
    for arg, record in bad:
        with pytest.raises(ValueError, match=re.escape(arg)):
            ops.gdn_commit(pool, record, qsl, src, n)
    with pytest.raises(ValueError, match="boundary"):
        ops.gdn_commit(pool, rec, qsl, src, n, boundary_indices=i32([[1], [2]], device))
    assert same_bits(pool, before)


CONV_CASES = {
    "conv_state_len": ("conv_state", lambda a, d: a.update(conv_state=a["conv_state"][:, :-1])),
    "weight_channels": ("weight", lambda a, d: a.update(weight=a["weight"][:-1])),
    "bias_shape": ("bias", lambda a, d: a.update(bias=a["bias"][:-1])),
    "dilation": ("dilation", lambda a, d: a.update(dilation=0)),
    "activation": ("activation", lambda a, d: a.update(activation="relu")),
    "x_dtype": ("x", lambda a, d: a.update(x=a["x"].double())),
    "slot_range": ("state_indices", lambda a, d: a.update(state_indices=i32([S, 0], d))),
    "qsl_past_end": ("query_start_loc", lambda a, d: a.update(query_start_loc=i32([0, 3, 9], d))),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_short_conv_verify_rejects(device, case):
    arg, mutate = CONV_CASES[case]
    kwargs = dict(x=torch.randn(6, 5, device=device), weight=torch.randn(5, 4, device=device),
                  bias=torch.randn(5, device=device), conv_state=torch.randn(S, 3, 5, device=device),
                  state_indices=i32([0, 1], device), query_start_loc=qsl_from_lengths([3, 3], device),
                  dilation=1, activation="silu")
    mutate(kwargs, device)
    with pytest.raises(ValueError, match=arg):
        ops.short_conv_verify(**kwargs)


def test_unvalidated_out_of_range_metadata_is_skipped_or_clamped(gdn, device):
    """Memory safety (validate=False): slots >= S are skipped, counts and windows clamped.
    Every pool is the first S slots of a larger, NaN-fenced buffer, so a missing guard
    writes into (or reads from) the fence and shows."""
    inp, pool, qsl, src, rec = gdn
    T = inp.q.shape[0]
    big, work = fenced(pool)
    # row 0: count 9 clamps to its window of 3, boundary 100 skipped; row 1: source slot 99
    # skipped; row 2: query_start_loc past T clamps to an empty window; row 3: dst 50 skipped
    wild_qsl = i32([0, 3, 6, 50, 50], device)
    ops.gdn_commit(work, rec, wild_qsl, i32([0, 99, 2, 1], device), i32([9, 2, 4, 1], device),
                   i32([3, 1, 2, 50], device), i32([[100, 4], [5, 5], [-7, 5], [5, 5]], device),
                   i32([[1, 2], [1, 2], [1, 1], [1, 1]], device), validate=False)
    ref = pool.clone()
    ops.gdn_commit(ref, rec, qsl, i32([0, -1], device), i32([3, 0], device), i32([3, -1], device),
                   i32([[-1, 4], [-1, -1]], device), i32([[1, 2], [1, 2]], device))
    assert same_bits(work, ref) and big[S:].isnan().all()

    # verify: row 1's slot 77 is skipped (its tokens stay poisoned); row 2's window [4, 60)
    # clamps to [4, T)
    big, fenced_pool = fenced(pool)
    out = torch.full((T, HV, V), float("nan"), device=device)
    bufs = [torch.full(r.shape, float("nan"), device=device) for r in rec]
    torch.ops.ssm_spec.gdn_verify(*inp.args(), fenced_pool, i32([0, 77, 1], device),
                                  i32([0, 3, 4, 60], device), out, *bufs, K**-0.5, True)
    want, want_rec = ops.gdn_verify(*inp.args(), pool, i32([0, -1, 1], device), i32([0, 3, 4, T], device))
    assert out[3].isnan().all() and all(b[3].isnan().all() for b in bufs)
    keep = [0, 1, 2, 4, 5]
    assert same_bits(out[keep], want[keep])
    assert all(same_bits(b[keep], w[keep]) for b, w in zip(bufs, want_rec))

    # snapshot: snapshot slots >= S are not written
    big, fenced_pool = fenced(pool)
    ops.gdn_snapshot_verify(*inp.args(), fenced_pool, src, qsl, i32([2, 7, 3, 40, 4, 5], device),
                            validate=False)
    assert big[S:].isnan().all()

    # short conv: verify skips slot 99; commit clamps and skips as above
    state = torch.randn(S, 3, 5, device=device)
    x = torch.randn(T, 5, device=device)
    w = torch.randn(5, 4, device=device)
    conv_out = torch.full((T, 5), float("nan"), device=device)
    rec_x = torch.full((T, 5), float("nan"), device=device)
    big, fenced_state = fenced(state)
    torch.ops.ssm_spec.short_conv_verify(x, w, None, fenced_state, i32([0, 99], device), qsl,
                                         conv_out, rec_x, 1, "silu")
    assert conv_out[3:].isnan().all() and not conv_out[:3].isnan().any()
    rec_x = x.clone()
    ops.short_conv_commit(fenced_state, rec_x, wild_qsl, i32([0, 99, 2, 1], device),
                          i32([9, 2, 4, 1], device), i32([3, 1, 2, 50], device),
                          i32([[100], [5], [-7], [5]], device), i32([[1], [1], [1], [1]], device),
                          validate=False)
    ref_state = state.clone()
    ops.short_conv_commit(ref_state, rec_x, qsl, i32([0, -1], device), i32([3, 0], device),
                          i32([3, -1], device))
    assert same_bits(fenced_state, ref_state) and big[S:].isnan().all()


def test_commit_protects_the_checkpoint_of_a_row_accepting_nothing(gdn, device):
    inp, pool, qsl, src, rec = gdn
    before = pool.clone()
    with pytest.raises(ValueError, match="dst_indices"):
        ops.gdn_commit(pool, rec, qsl, src, i32([2, 0], device), dst_indices=i32([1, 1], device))
    with pytest.raises(ValueError, match="boundary_indices"):
        ops.gdn_commit(pool, rec, qsl, src, i32([2, 0], device), dst_indices=i32([0, 1], device),
                       boundary_indices=i32([[1], [-1]], device), boundary_offsets=i32([[1], [0]], device))
    assert same_bits(pool, before)


SNAPSHOT_CASES = {
    "duplicate": ("snapshot_indices", [2, 2, 3, 4, 5, -1]),
    "another_source": ("snapshot_indices", [2, 3, 1, -1, -1, -1]),
    "empty_row_source": ("snapshot_indices", [1, 2, 3, -1, -1, -1]),  # row 1's window is empty
    "slot_range": ("snapshot_indices", [2, 3, 4, S, -1, -1]),
    "too_short": ("snapshot_indices", [2, 3]),
    "dtype": ("snapshot_indices", None),
}


@pytest.mark.parametrize("case", sorted(SNAPSHOT_CASES))
def test_gdn_snapshot_verify_rejects(gdn, device, case):
    inp, pool, qsl, src, _ = gdn
    arg, snaps = SNAPSHOT_CASES[case]
    snap = i32(snaps, device) if snaps is not None else torch.arange(2, 8, device=device)
    if case == "empty_row_source":
        qsl = i32([0, 6, 6], device)
    before = pool.clone()
    with pytest.raises(ValueError, match=arg):
        ops.gdn_snapshot_verify(*inp.args(), pool, src, qsl, snap)
    assert same_bits(pool, before)


def test_wrappers_reject_wrong_kinds_before_reading_shapes(gdn, device):
    inp, pool, qsl, src, rec = gdn
    n = i32([1, 1], device)
    cases = [
        ("q", lambda: ops.gdn_verify(inp.q[:, 0], inp.k, inp.v, inp.g, inp.beta, pool, src, qsl)),
        ("q", lambda: ops.gdn_verify(inp.q.tolist(), inp.k, inp.v, inp.g, inp.beta, pool, src, qsl)),
        ("v", lambda: ops.gdn_verify(inp.q, inp.k, inp.v[:, 0, 0], inp.g, inp.beta, pool, src, qsl)),
        ("q, v", lambda: ops.gdn_verify(inp.q[..., :0], inp.k[..., :0], inp.v, inp.g, inp.beta,
                                        pool[..., :0, :], src, qsl)),
        ("scale", lambda: ops.gdn_verify(*inp.args(), pool, src, qsl, scale="x")),
        ("scale", lambda: ops.gdn_verify(*inp.args(), pool, src, qsl, scale=float("nan"))),
        ("use_qk_l2norm", lambda: ops.gdn_verify(*inp.args(), pool, src, qsl, use_qk_l2norm="no")),
        ("src_indices", lambda: ops.gdn_commit(pool, rec, qsl, i32(0, device), n)),
        ("src_indices", lambda: ops.gdn_commit(pool, rec, qsl, [0, 1], n)),
        ("record", lambda: ops.gdn_commit(pool, None, qsl, src, n)),
        ("record", lambda: ops.gdn_commit(pool, rec[:2], qsl, src, n)),
        ("state", lambda: ops.gdn_commit(pool[:1].expand(S, -1, -1, -1), rec, qsl, src, n,
                                         dst_indices=i32([2, 3], device))),
        ("x", lambda: ops.short_conv_verify(torch.randn(6, device=device), torch.randn(5, 4, device=device),
                                            None, torch.randn(S, 3, 5, device=device), src, qsl)),
        ("dilation", lambda: ops.short_conv_verify(torch.randn(6, 5, device=device), torch.randn(5, 2, device=device),
                                                   None, torch.randn(S, 1, 5, device=device), src, qsl,
                                                   dilation=True)),
        ("src_indices", lambda: ops.short_conv_commit(torch.randn(S, 3, 5, device=device),
                                                      torch.randn(6, 5, device=device), qsl, [0, 1], n)),
    ]
    before = pool.clone()
    for arg, call in cases:
        with pytest.raises(ValueError, match=arg):
            call()
    assert same_bits(pool, before)


def test_autograd_inputs_are_refused(gdn, device):
    inp, pool, qsl, src, rec = gdn
    q = inp.q.detach().clone().requires_grad_()
    with pytest.raises(ValueError, match="q"):
        ops.gdn_verify(q, inp.k, inp.v, inp.g, inp.beta, pool, src, qsl)
    leaf = pool.clone().requires_grad_()
    with pytest.raises(ValueError, match="state"):
        ops.gdn_commit(leaf, rec, qsl, src, i32([1, 1], device))
    with torch.no_grad():
        out, _ = ops.gdn_verify(q, inp.k, inp.v, inp.g, inp.beta, pool, src, qsl)
    assert not out.requires_grad


def test_validate_true_inside_compile_is_a_clear_error(gdn):
    inp, pool, qsl, src, _ = gdn
    torch._dynamo.reset()
    f = torch.compile(lambda *a: ops.gdn_verify(*a, validate=True), fullgraph=True)
    with pytest.raises(Exception, match="validate"):
        f(*inp.args(), pool, src, qsl)
