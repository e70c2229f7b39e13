"""A validated commit refuses a record with windows other than its verify's (a
``query_start_loc`` of another layout would replay other tokens and write a wrong state), and
nothing is written; the check needs no host read beyond what validation reads anyway, and
is off with validation."""

import pytest
import torch

from ssm_spec import ops
from tests.helpers import gdn_inputs, i32, qsl_from_lengths, random_pool, same_bits

HV, H, K, V, S = 4, 2, 8, 6, 6


@pytest.fixture
def setup(device):
    gen = torch.Generator().manual_seed(0)
    inp = gdn_inputs(6, H, HV, K, V, device, gen=gen)
    pool = random_pool(S, HV, K, V, device, gen=gen)
    return inp, pool, qsl_from_lengths([3, 3], device), i32([0, 1], device)


def _gdn_records(inp, pool, qsl, src, device):
    """The records of the wrappers whose records gdn_commit replays."""
    yield "gdn_verify", ops.gdn_verify(*inp.args(), pool, src, qsl)[1]
    yield "gdn_closed_form_verify", ops.gdn_closed_form_verify(*inp.args(), pool, src, qsl, max_window=3)[1]
    _, prev = ops.gdn_verify(*inp.args(), pool, src, qsl)
    folded = pool.clone()
    yield "gdn_folded_verify", ops.gdn_folded_verify(*inp.args(), folded, src, qsl, prev, qsl[:-1].clone(),
                                                     i32([0, 0], device))[1]


def test_gdn_commit_refuses_a_record_of_other_windows(setup, device):
    inp, pool, qsl, src = setup
    n = i32([2, 2], device)
    for name, rec in _gdn_records(inp, pool, qsl, src, device):
        work = pool.clone()
        for other in ([0, 2, 6], [0, 4, 6], [1, 3, 6]):
            with pytest.raises(ValueError, match=r"^gdn_commit: query_start_loc: got \[.*\(row 0: .*; expected "
                                                 r"\[0, 3, 6\], the query_start_loc record was made with"):
                ops.gdn_commit(work, rec, i32(other, device), src, n)
        with pytest.raises(ValueError, match=r"query_start_loc: got \[0, 0, 3\] \(row 1: .*row 1: \[3, 6\)"):
            ops.gdn_commit(work, rec, i32([0, 0, 3], device), src, i32([0, 2], device))  # row 0's window, row 1
        assert same_bits(work, pool), name
        ops.gdn_commit(work, rec, i32([0, 2, 6], device), src, i32([0, 0], device))  # writes nothing
        assert same_bits(work, pool), name
        ops.gdn_commit(work, rec, qsl.clone(), src, n)  # the same windows in another tensor
        want = pool.clone()
        ops.gdn_commit(want, rec, qsl, src, n)
        assert same_bits(work, want), name
        work, want = pool.clone(), pool.clone()
        ops.gdn_commit(work, rec, i32([1, 3, 6], device), i32([-1, 1], device), n)  # row 0 pads: only row 1 counts
        ops.gdn_commit(want, rec, qsl, i32([-1, 1], device), n)
        assert same_bits(work, want), name


def test_short_conv_commit_refuses_rec_x_of_other_windows(device):
    x, w = torch.randn(6, 5, device=device), torch.randn(5, 4, device=device)
    state, src, qsl = torch.randn(S, 3, 5, device=device), i32([0, 1], device), qsl_from_lengths([3, 3], device)
    _, rec_x = ops.short_conv_verify(x, w, None, state, src, qsl)
    before = state.clone()
    with pytest.raises(ValueError, match=r"^short_conv_commit: query_start_loc: got \[0, 2, 6\] \(row 0: tokens "
                                         r"\[0, 2\)\); expected \[0, 3, 6\], the query_start_loc rec_x was made with"):
        ops.short_conv_commit(state, rec_x, i32([0, 2, 6], device), src, i32([1, 1], device))
    assert same_bits(state, before)
    ops.short_conv_commit(state, rec_x, qsl, src, i32([1, 1], device))


def test_a_record_refilled_by_the_op_or_built_elsewhere_is_not_checked(setup, device):
    """The op forgets the windows of the buffers it rewrites; a record the caller assembles
    (stacked, sliced) has no known windows; with validation off nothing is compared."""
    inp, pool, qsl, src = setup
    n = i32([1, 1], device)
    out, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    other = i32([0, 2, 6], device)
    torch.ops.ssm_spec.gdn_verify(*inp.args(), pool, src, other, out, *rec, K**-0.5, True)
    ops.gdn_commit(pool.clone(), rec, other, src, n)
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    ops.gdn_commit(pool.clone(), ops.ReplayRecord(*(t.clone() for t in rec)), other, src, n)
    ops.gdn_commit(pool.clone(), rec, other, src, n, validate=False)
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.gdn_commit(pool.clone(), rec, other, src, n)
