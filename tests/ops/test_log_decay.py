"""``g`` is a log decay (``<= 0``): with validation on, every window op refuses a ``g > 0`` or
NaN on a token a live row reads, naming ``g[t, h]``, before anything is written; tokens no
live row reads (padding rows, tokens past every window) may hold anything."""

import pytest
import torch

from ssm_spec import ops
from tests.helpers import verified_gdn, i32, qsl_from_lengths, same_bits

HV, H, K, V, S = 4, 2, 8, 6, 6


@pytest.fixture
def setup(device):
    inp, pool, _, _, rec = verified_gdn(device, H, HV, K, V, S)
    return inp, pool, rec


def _calls(inp, g, pool, src, qsl, rec, device):
    q, k, v, _, beta = inp.args()
    a = (q, k, v, g, beta, pool, src, qsl)
    zero = i32([0] * src.shape[0], device)
    ring = ops.RecordRing.zeros(S, 8, H, HV, K, V, device=device)
    return {
        "gdn_verify": lambda: ops.gdn_verify(*a),
        "gdn_snapshot_verify": lambda: ops.gdn_snapshot_verify(*a, i32([2, 3, 4, 5, -1, -1], device)),
        "gdn_folded_verify": lambda: ops.gdn_folded_verify(*a, rec, zero, i32([1] * src.shape[0], device)),
        "gdn_closed_form_verify": lambda: ops.gdn_closed_form_verify(*a, max_window=3),
        "gdn_closed_form_folded_verify": lambda: ops.gdn_closed_form_folded_verify(*a, ring, zero, zero, 0,
                                                                                    max_window=3),
    }


@pytest.mark.parametrize("value", [0.5, float("nan")])
def test_a_positive_or_nan_log_decay_is_refused_before_anything_is_written(setup, device, value):
    inp, pool, rec = setup
    g = inp.g.clone()
    g[4, 1] = value
    for op, call in _calls(inp, g, pool, i32([0, 1], device), qsl_from_lengths([3, 3], device), rec,
                           device).items():
        before = pool.clone()
        with pytest.raises(ValueError, match=rf"^{op}: g\[4, 1\]: got {value}; expected <= 0"):
            call()
        assert same_bits(pool, before), op


def test_tokens_no_live_row_reads_may_hold_any_g(setup, device):
    inp, pool, rec = setup
    g = inp.g.clone()
    g[0] = 0.0  # the bound itself
    g[3:5] = 2.0  # row 1: a padding row
    g[5] = float("nan")  # past every window
    calls = _calls(inp, g, pool.clone(), i32([0, -1], device), i32([0, 3, 5], device), rec, device)
    for op, call in calls.items():
        call()
    with pytest.raises(ValueError, match=r"g\[3, 0\]"):
        ops.gdn_verify(*inp.args()[:3], g, inp.beta, pool, i32([0, 1], device), i32([0, 3, 5], device))
    ops.gdn_verify(*inp.args()[:3], g, inp.beta, pool, i32([0, 1], device), i32([0, 3, 5], device),
                   validate=False)  # off: not read
