"""Malformed inputs raise a ValueError naming the argument and change no state; with
validation off, out-of-range metadata is skipped or clamped, never dereferenced."""

import pytest
import torch

from ssm_spec import ops
from tests.helpers import gdn_inputs, i32, qsl_from_lengths, random_pool, same_bits

HV, H, K, V, S = 4, 2, 8, 6, 6


@pytest.fixture
def gdn(device):
    gen = torch.Generator().manual_seed(0)
    inp = gdn_inputs(6, H, HV, K, V, device, gen=gen)
    pool = random_pool(S, HV, K, V, device, gen=gen)
    qsl = qsl_from_lengths([3, 3], device)
    src = i32([0, 1], device)
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    return inp, pool, qsl, src, rec


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
    bad = [("rec_u", rec._replace(u=rec.u[..., :-1])), ("rec_k", rec._replace(k=rec.k.double())),
           ("rec_decay", rec._replace(decay=rec.decay[:-1])),
           ("rec_u", ops.ReplayRecord(*(x.unsqueeze(0) for x in rec)))]  # grouped record, 4-D state
    for arg, record in bad:
        with pytest.raises(ValueError, match=arg):
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
    """Memory safety: slots >= S are skipped, counts and windows clamped (validate=False)."""
    inp, pool, qsl, src, rec = gdn
    T = inp.q.shape[0]
    work = pool.clone()
    # row 0: count 9 clamps to its window of 3; row 1: source slot 99 is skipped;
    # row 2: query_start_loc past T clamps to an empty window
    wild_qsl = i32([0, 3, 6, 50], device)
    ops.gdn_commit(work, rec, wild_qsl, i32([0, 99, 2], device), i32([9, 2, 4], device),
                   i32([3, 1, 2], device), i32([[100, 4], [5, 5], [-7, 5]], device),
                   i32([[1, 2], [1, 2], [1, 1]], device), validate=False)
    ref = pool.clone()
    ops.gdn_commit(ref, rec, qsl, i32([0, -1], device), i32([3, 0], device), i32([3, -1], device),
                   i32([[-1, 4], [-1, -1]], device), i32([[1, 2], [1, 2]], device))
    assert same_bits(work, ref)
    out, _ = ops.gdn_verify(*inp.args(), pool, i32([0, 77, 1], device), i32([0, 3, 4, 60], device),
                            validate=False)
    assert out.shape[0] == T
    state = torch.randn(S, 3, 5, device=device)
    rec_x = torch.randn(T, 5, device=device)
    before = state.clone()
    ops.short_conv_commit(state, rec_x, wild_qsl, i32([0, 99, 2], device), i32([9, 2, 4], device),
                          i32([3, 1, 2], device), validate=False)
    ref_state = before.clone()
    ops.short_conv_commit(ref_state, rec_x, qsl, i32([0, -1], device), i32([3, 0], device),
                          i32([3, -1], device))
    assert same_bits(state, ref_state)
