"""The oracles checked against independent formulations."""

import torch
import torch.nn.functional as F

from ssm_spec import reference
from tests.helpers import gdn_inputs, rel_err


def test_gdn_reference_matches_closed_form_delta_rule():
    """Against the textbook delta rule written as matrices, in float64:
    S_t = d_t (I - beta_t k k^T) S_{t-1} + beta_t k v^T,  o_t = S_t^T q."""
    T, H, HV, K, V = 6, 2, 4, 5, 3
    inp = gdn_inputs(T, H, HV, K, V, "cpu", dtype=torch.float64, strided=False)
    s0 = torch.randn(HV, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = reference.gdn_native_step(*inp.args(), s0, scale=0.7)
    assert res.out.dtype == torch.float64
    for hv in range(HV):
        s = s0[hv]
        for t in range(T):
            k = inp.k[t, hv // 2] / torch.sqrt(inp.k[t, hv // 2].norm() ** 2 + 1e-6)
            q = inp.q[t, hv // 2] / torch.sqrt(inp.q[t, hv // 2].norm() ** 2 + 1e-6) * 0.7
            d, b = inp.g[t, hv].double().exp(), inp.beta[t, hv]
            s = d * (torch.eye(K, dtype=torch.float64) - b * torch.outer(k, k)) @ s + b * torch.outer(k, inp.v[t, hv])
            assert rel_err(res.states[t, hv], s) < 1e-6
            assert rel_err(res.out[t, hv], s.T @ q) < 1e-6


def test_gdn_reference_writes_v_when_beta_is_one():
    """With beta = 1 and no decay the delta rule stores v at the normalised key: S^T k̂ = v
    (up to |k̂|^2 = |k|^2 / (|k|^2 + 1e-6))."""
    inp = gdn_inputs(1, 1, 1, 8, 4, "cpu", dtype=torch.float64, strided=False, g_fill=0.0, beta_fill=1.0)
    res = reference.gdn_native_step(*inp.args(), torch.randn(1, 8, 4, dtype=torch.float64,
                                                             generator=torch.Generator().manual_seed(2)))
    khat = res.khat[0, 0]
    assert abs((khat @ khat).item() - 1) < 1e-5
    assert rel_err(res.states[0, 0].T @ khat, inp.v[0, 0]) < 1e-5


def test_short_conv_reference_matches_conv1d():
    """Against torch.nn.functional.conv1d with the state as left context."""
    for ks, dil in [(2, 1), (4, 1), (3, 2), (4, 3)]:
        C, T = 7, 9
        lc = (ks - 1) * dil
        x = torch.randn(T, C, dtype=torch.float64)
        w = torch.randn(C, ks, dtype=torch.float64)
        b = torch.randn(C, dtype=torch.float64)
        state = torch.randn(lc, C, dtype=torch.float64)
        res = reference.short_conv_native_step(x, w, b, state, dil, "silu")
        full = torch.cat([state, x]).T.unsqueeze(0)  # [1, C, Lc + T]
        y = F.conv1d(full, w.unsqueeze(1), b, dilation=dil, groups=C)[0].T  # [T, C]
        assert rel_err(res.out, F.silu(y)) < 1e-12
        assert torch.equal(res.states[-1], torch.cat([state, x])[-lc:])
        assert torch.equal(res.states[0], torch.cat([state, x])[1 : 1 + lc])
