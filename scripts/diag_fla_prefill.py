"""How close fla-core's chunked prefill is to the gated delta rule in float64 (development aid).

Prints the relative error (float64 norms) of fla's ``chunk_gated_delta_rule`` (chunk sizes 16,
32, 64) and of our fp32 token loop, both against the float64 token loop, on two input
families: the strongly gated random layers of tests/modules/test_modules.py (g down to about -8 per
token) and mild gates like a trained model's (g in [-0.5, 0]). Run on CUDA with fla-core
installed and TRITON_F32_DEFAULT=ieee.
"""
import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from ssm_spec import reference
from tests.helpers import rel_err


def inputs(T, H, HV, K, V, strong, gen):
    q = torch.randn(T, H, K, generator=gen) * 1.7
    k = torch.randn(T, H, K, generator=gen) * 1.7
    v = torch.randn(T, HV, V, generator=gen) * 1.7
    if strong:  # as _hf_layer: A in [1/e, e], softplus of N(0, 1.7) inputs
        g = -torch.empty(HV).uniform_(-1, 1, generator=gen).exp() * torch.nn.functional.softplus(
            torch.randn(T, HV, generator=gen) * 1.7)
        beta = torch.sigmoid(torch.randn(T, HV, generator=gen) * 1.7)
    else:
        g = -torch.rand(T, HV, generator=gen) * 0.5
        beta = torch.sigmoid(torch.randn(T, HV, generator=gen))
    return [x.cuda() for x in (q, k, v, g, beta)]


gen = torch.Generator().manual_seed(0)
print(f"{'case':<34} {'ours fp32':>10} {'fla c16':>10} {'fla c32':>10} {'fla c64':>10}")
for T, H, HV, K, V in [(40, 2, 4, 16, 32), (300, 2, 4, 16, 32), (300, 16, 32, 128, 128)]:
    for strong in (True, False):
        for h0 in (False, True):
            q, k, v, g, beta = inputs(T, H, HV, K, V, strong, gen)
            s0 = (torch.randn(HV, K, V, generator=gen) * 0.5).cuda() if h0 else torch.zeros(HV, K, V, device="cuda")
            ref = reference.gdn_native_step(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                            s0.double(), keep_states=False)
            ours = reference.gdn_native_step(q, k, v, g, beta, s0, keep_states=False)
            row = [rel_err(ours.out, ref.out)]
            for cs in (16, 32, 64):
                o, s = chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                              initial_state=s0[None].clone(), output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, chunk_size=cs)
                row.append(max(rel_err(o[0], ref.out), rel_err(s[0], ref.states[-1])))
            name = f"T={T} HV={HV} K={K} {'strong' if strong else 'mild'} h0={'rand' if h0 else '0'}"
            print(f"{name:<34} " + " ".join(f"{x:10.2e}" for x in row))
