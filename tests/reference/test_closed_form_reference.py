"""The closed-form window oracle (``ssm_spec.reference_closed_form``, the fast mode's twin)
against the token loop: equal in float64 up to rounding, extreme gates included."""

import pytest
import torch

from ssm_spec import reference
from ssm_spec.reference_closed_form import gdn_closed_form_step
from tests.helpers import gdn_inputs, rel_err


@pytest.mark.parametrize("shape", [(4, 2, 16, 24), (2, 2, 8, 8), (6, 3, 5, 7)])
@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("gates", ["random", "strong", "none"])
def test_closed_form_equals_token_loop_in_float64(shape, W, gates):
    HV, H, K, V = shape
    gen = torch.Generator().manual_seed(W * 31 + HV)
    inp = gdn_inputs(W, H, HV, K, V, "cpu", gen=gen)
    # strong: exp(-G_j) alone overflows past W = 8 (exp(800)); the differences stay <= 1
    g = {"random": inp.g, "strong": inp.g * 0 - 100.0, "none": inp.g * 0}[gates]
    s0 = torch.randn(HV, K, V, generator=gen, dtype=torch.float64)
    args = (inp.q, inp.k, inp.v, g, inp.beta, s0)
    ref = reference.gdn_native_step(*args, dtype=torch.float64)
    got = gdn_closed_form_step(*args, dtype=torch.float64)
    assert rel_err(got.out, ref.out) < 1e-12
    assert rel_err(got.u, ref.u) < 1e-12
    assert torch.equal(got.khat, ref.khat) and torch.equal(got.decay, ref.decay)
    assert rel_err(got.states[0], ref.states[-1]) < 1e-12
    assert torch.isfinite(got.out).all()


def test_closed_form_record_replays_to_the_token_loop_state():
    """Commit replays the closed-form record (fma(k̂, u, S d) per token) onto the checkpoint and
    lands on the token loop's state up to rounding (float64)."""
    HV, H, K, V, W = 4, 2, 16, 12, 5
    inp = gdn_inputs(W, H, HV, K, V, "cpu", gen=torch.Generator().manual_seed(3))
    s0 = torch.randn(HV, K, V, dtype=torch.float64)
    got = gdn_closed_form_step(inp.q, inp.k, inp.v, inp.g, inp.beta, s0, dtype=torch.float64)
    ref = reference.gdn_native_step(inp.q, inp.k, inp.v, inp.g, inp.beta, s0, dtype=torch.float64)
    s = s0.clone()
    for t in range(W):
        s = reference.gdn_replay_update(s, got.khat[t].repeat_interleave(HV // H, 0), got.u[t], got.decay[t])
        assert rel_err(s, ref.states[t]) < 1e-12


def test_closed_form_empty_window_and_bad_shapes():
    HV, H, K, V = 2, 1, 4, 3
    inp = gdn_inputs(0, H, HV, K, V, "cpu")
    res = gdn_closed_form_step(inp.q, inp.k, inp.v, inp.g, inp.beta, torch.randn(HV, K, V))
    assert res.out.shape == (0, HV, V) and res.states.shape == (0, HV, K, V)
    with pytest.raises(ValueError, match="initial_state"):
        gdn_closed_form_step(inp.q, inp.k, inp.v, inp.g, inp.beta, torch.randn(HV, K + 1, V))


@pytest.mark.parametrize("P", [1, 3, 7])
def test_closed_form_with_a_history_equals_the_token_loop_over_both(P):
    """A pending history (the lazy commit's ring) is the token loop over history + window from
    the checkpoint: outputs, corrections and the final state, float64."""
    HV, H, K, V, W = 4, 2, 16, 12, 4
    gen = torch.Generator().manual_seed(P)
    inp = gdn_inputs(P + W, H, HV, K, V, "cpu", gen=gen)
    s0 = torch.randn(HV, K, V, generator=gen, dtype=torch.float64)
    ref = reference.gdn_native_step(inp.q, inp.k, inp.v, inp.g, inp.beta, s0, dtype=torch.float64)
    hist = (ref.u[:P], ref.khat[:P], inp.g[:P].double())
    w = slice(P, P + W)
    got = gdn_closed_form_step(inp.q[w], inp.k[w], inp.v[w], inp.g[w], inp.beta[w], s0, dtype=torch.float64,
                               history=hist)
    assert rel_err(got.out, ref.out[w]) < 1e-12
    assert rel_err(got.u, ref.u[w]) < 1e-12
    assert rel_err(got.states[0], ref.states[-1]) < 1e-12
    with pytest.raises(ValueError, match="history"):
        gdn_closed_form_step(inp.q[w], inp.k[w], inp.v[w], inp.g[w], inp.beta[w], s0, history=(hist[0][:, :1], *hist[1:]))
