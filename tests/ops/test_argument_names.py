"""Errors name the argument the caller passed, and the one that is out of line: a state of
another layer is ``state`` (not ``q``, nor a record field), a record's fields are
``record.u`` ... in the wrappers, and slots a commit writes because ``dst_indices`` was left
out are ``src_indices``. Nothing is written by a refused call."""

import pytest
import torch

from ssm_spec import ops
from tests.helpers import verified_gdn, i32, random_pool, same_bits

HV, H, K, V, S = 4, 2, 8, 6, 6


@pytest.fixture
def gdn(device):
    return verified_gdn(device, H, HV, K, V, S)


def _other_pool(device, hv=HV, k=K, v=V):
    return random_pool(S, hv, k, v, device, gen=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dims", [dict(hv=5), dict(hv=8), dict(k=7)])
def test_window_ops_name_a_state_of_another_layer_state(gdn, device, dims):
    inp, _, qsl, src, rec = gdn
    snaps = i32([2, 3, 4, 5, -1, -1], device)
    calls = {
        "gdn_verify": lambda p: ops.gdn_verify(*inp.args(), p, src, qsl),
        "gdn_snapshot_verify": lambda p: ops.gdn_snapshot_verify(*inp.args(), p, src, qsl, snaps),
        "gdn_folded_verify": lambda p: ops.gdn_folded_verify(*inp.args(), p, src, qsl, rec, qsl[:-1].clone(),
                                                             i32([1, 1], device)),
        "gdn_closed_form_verify": lambda p: ops.gdn_closed_form_verify(*inp.args(), p, src, qsl, max_window=3),
    }
    for op, call in calls.items():
        pool = _other_pool(device, **dims)
        before = pool.clone()
        with pytest.raises(ValueError, match=rf"^{op}: state: got (HV|K) = "):
            call(pool)
        assert same_bits(pool, before), op


def test_gdn_verify_names_the_activation_out_of_line(gdn):
    inp, pool, qsl, src, _ = gdn
    with pytest.raises(ValueError, match=r"^gdn_verify: q: got K = 7 .*as in k, state"):
        ops.gdn_verify(inp.q[..., :-1], inp.k, inp.v, inp.g, inp.beta, pool, src, qsl)
    with pytest.raises(ValueError, match=r"^gdn_verify: g: got T = 5 "):
        ops.gdn_verify(inp.q, inp.k, inp.v, inp.g[:-1], inp.beta, pool, src, qsl)
    with pytest.raises(ValueError, match=r"^gdn_verify: q, k: got H = 1 in q .* H = 2 in k"):
        ops.gdn_verify(inp.q[:, :1], inp.k, inp.v, inp.g, inp.beta, pool, src, qsl)


@pytest.mark.parametrize("dims", [dict(hv=5), dict(hv=8)])
def test_gdn_commit_names_a_state_of_another_layer_state(gdn, device, dims):
    _, _, qsl, src, rec = gdn
    pool = _other_pool(device, **dims)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"^gdn_commit: state: got HV = \d+ .*as in record\.u, record\.decay"):
        ops.gdn_commit(pool, rec, qsl, src, i32([1, 1], device))
    assert same_bits(pool, before)


@pytest.mark.parametrize("dims, dim", [(dict(v=5), "V"), (dict(k=7), "K")])
def test_gdn_commit_names_state_and_record_where_only_they_disagree(gdn, device, dims, dim):
    _, _, qsl, src, rec = gdn
    pool = _other_pool(device, **dims)
    before = pool.clone()
    with pytest.raises(ValueError, match=rf"^gdn_commit: state, record\.[uk]: got {dim} = "):
        ops.gdn_commit(pool, rec, qsl, src, i32([1, 1], device))
    with pytest.raises(ValueError, match=r"^gdn_commit: record\.u: got a 3-D tensor .*grouped record"):
        ops.gdn_commit(pool.unsqueeze(0), rec, qsl, src, i32([1, 1], device))
    assert same_bits(pool, before)


def test_the_op_form_names_its_own_arguments(gdn, device):
    _, _, qsl, src, rec = gdn
    pool = _other_pool(device, hv=5)
    n, dst = i32([1, 1], device), src
    none = torch.empty((2, 0), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^gdn_commit: state: got HV = 5 .*as in rec_u, rec_decay"):
        torch.ops.ssm_spec.gdn_commit(pool, *rec, qsl, src, n, dst, none, none)


@pytest.mark.parametrize("kind", ["gdn", "short_conv"])
def test_commits_name_src_indices_for_the_slots_they_write_without_dst_indices(gdn, device, kind):
    _, pool, qsl, _, rec = gdn
    if kind == "gdn":
        op, state = "gdn_commit", pool
        call = lambda *a, **kw: ops.gdn_commit(pool, rec, qsl, *a, **kw)  # noqa: E731
    else:
        op, state = "short_conv_commit", torch.randn(S, 3, 5, device=device)
        rec_x = torch.randn(6, 5, device=device)
        call = lambda *a, **kw: ops.short_conv_commit(state, rec_x, qsl, *a, **kw)  # noqa: E731
    before = state.clone()
    same = i32([1, 1], device)
    with pytest.raises(ValueError, match=rf"^{op}: src_indices\[1\]: got slot 1; .*via src_indices\[0\].*"
                                         "dst_indices left out"):
        call(same, i32([1, 1], device))
    with pytest.raises(ValueError, match=rf"^{op}: src_indices\[0\]: got slot 1; .*row 1 reads it"):
        call(same, i32([1, 0], device))
    with pytest.raises(ValueError, match=rf"^{op}: dst_indices\[1\]: got slot 3; .*via dst_indices\[0\]\)$"):
        call(i32([0, 1], device), i32([1, 1], device), dst_indices=i32([3, 3], device))
    assert same_bits(state, before)


def test_short_conv_commit_names_conv_state_and_rec_x_where_they_disagree(gdn, device):
    _, _, qsl, src, _ = gdn
    state = torch.randn(S, 3, 4, device=device)
    before = state.clone()
    with pytest.raises(ValueError, match=r"^short_conv_commit: conv_state, rec_x: got C = 4 in conv_state"):
        ops.short_conv_commit(state, torch.randn(6, 5, device=device), qsl, src, i32([1, 1], device))
    with pytest.raises(ValueError, match=r"^short_conv_commit: rec_x: got a 2-D tensor .*grouped rec_x"):
        ops.short_conv_commit(state.unsqueeze(0), torch.randn(6, 4, device=device), qsl, src, i32([1, 1], device))
    assert same_bits(state, before)


def test_folded_and_ring_ops_name_the_wrapper_arguments(gdn, device):
    inp, pool, qsl, src, rec = gdn
    before = pool.clone()
    short = rec._replace(u=rec.u[..., :-1])
    with pytest.raises(ValueError, match=r"^gdn_folded_verify: prev_record\.u: "):
        ops.gdn_folded_verify(*inp.args(), pool, src, qsl, short, qsl[:-1].clone(), i32([1, 1], device))
    fresh = ops.ReplayRecord.empty(inp.q, inp.v)
    with pytest.raises(ValueError, match=r"^gdn_folded_verify: record\.k: "):
        ops.gdn_folded_verify(*inp.args(), pool, src, qsl, rec, qsl[:-1].clone(), i32([1, 1], device),
                              record=fresh._replace(k=fresh.k[:, :1]))
    ring = ops.RecordRing.zeros(S, 8, H, HV, K, V, device=device)
    zero = i32([0, 0], device)
    with pytest.raises(ValueError, match=r"^gdn_closed_form_folded_verify: ring\.k: "):
        ops.gdn_closed_form_folded_verify(*inp.args(), pool, src, qsl, ring._replace(k=ring.k[..., :-1]), zero,
                                          zero, 3, max_window=3)
    with pytest.raises(ValueError, match=r"^gdn_closed_form_folded_verify: state_indices: "):
        ops.gdn_closed_form_folded_verify(*inp.args(), pool, src[:1], qsl, ring, zero, zero, 3, max_window=3)
    assert same_bits(pool, before)
