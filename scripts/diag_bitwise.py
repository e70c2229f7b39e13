"""Diagnose commit vs snapshot bit identity on the GPU (development aid)."""
import torch

from ssm_spec import ops
from ssm_spec.ops.gdn.verify import gdn_window_kernel
from tests.helpers import gdn_inputs, i32, random_pool


def emul(h, k, u, d):  # fma(k, u, h*d) emulated: exact products in float64, one rounding
    p = (h * d).float()
    return (k.double()[:, None] * u.double()[None, :] + p.double()).float()


for (HV, H, K, V) in [(4, 2, 16, 32), (8, 4, 64, 48), (4, 2, 32, 32), (4, 2, 16, 16), (2, 2, 16, 32)]:
    dev = "cuda"
    W = 4
    inp = gdn_inputs(W, H, HV, K, V, dev, gen=torch.Generator().manual_seed(3))
    pool = random_pool(2, HV, K, V, dev)
    qsl, src = i32([0, W], dev), i32([0], dev)
    out1, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    scratch = torch.cat([pool, torch.zeros(W, HV, K, V, device=dev)])
    out2 = ops.gdn_snapshot_verify(*inp.args(), scratch, src, qsl, i32(list(range(2, 2 + W)), dev))
    snaps = scratch[2:]
    line = [f"HV={HV} H={H} K={K} V={V}: out equal {torch.equal(out1, out2)}"]
    g = HV // H
    h = pool[0]
    for n in range(1, W + 1):
        work = pool.clone()
        ops.gdn_commit(work, rec, qsl, src, i32([n], dev))
        t = n - 1
        e = torch.stack([emul(h[hv], rec.k[t, hv // g], rec.u[t, hv], rec.decay[t, hv]) for hv in range(HV)])
        line.append(f"n={n}: commit==snap {torch.equal(work[0], snaps[t])} "
                    f"(#diff {(work[0] != snaps[t]).sum().item()}, max {(work[0]-snaps[t]).abs().max().item():.2e}) "
                    f"commit==emul {torch.equal(work[0], e)} snap==emul {torch.equal(snaps[t], e)}")
        h = snaps[t]
    print("\n  ".join(line))
try:
    print("compiled variants:", sum(len(c[0]) for c in gdn_window_kernel.device_caches.values()))
except Exception as ex:
    print("cache introspection failed", ex)

# Same-run check: one launch with records AND snapshots on; are its snapshots consistent
# with its own records?
from ssm_spec.ops.gdn.verify import launch_gdn_window

for (HV, H, K, V) in [(4, 2, 16, 32), (4, 2, 32, 32)]:
    dev = "cuda"
    W = 4
    inp = gdn_inputs(W, H, HV, K, V, dev, gen=torch.Generator().manual_seed(3))
    pool = random_pool(2, HV, K, V, dev)
    qsl, src = i32([0, W], dev), i32([0], dev)
    scratch = torch.cat([pool, torch.zeros(W, HV, K, V, device=dev)])
    out = torch.empty(W, HV, V, device=dev)
    rec = ops.ReplayRecord(torch.empty(W, HV, V, device=dev), torch.empty(W, H, K, device=dev),
                           torch.empty(W, HV, device=dev))
    launch_gdn_window(*inp.args(), scratch, src, qsl, i32(list(range(2, 2 + W)), dev), out, rec,
                      K**-0.5, True)
    snaps = scratch[2:]
    g = HV // H
    h = pool[0]
    res = []
    for t in range(W):
        e = torch.stack([emul(h[hv], rec.k[t, hv // g], rec.u[t, hv], rec.decay[t, hv]) for hv in range(HV)])
        # which heads / elements deviate
        bad = (snaps[t] != e)
        res.append(f"t={t}: same-run snap==emul {torch.equal(snaps[t], e)} bad per head {bad.flatten(1).sum(1).tolist()}")
        # try the hypothesis P unrounded: fma(k,u,h*d) with exact h*d
        e2 = torch.stack([(rec.k[t, hv // g].double()[:, None] * rec.u[t, hv].double()[None, :]
                           + h[hv].double() * rec.decay[t, hv].double()).float() for hv in range(HV)])
        # hypothesis: two roundings (k*u rounded, then add)
        e3 = torch.stack([((rec.k[t, hv // g][:, None] * rec.u[t, hv][None, :]) + (h[hv] * rec.decay[t, hv])) for hv in range(HV)])
        res.append(f"      unroundedP {torch.equal(snaps[t], e2)} mul+add {torch.equal(snaps[t], e3)}")
        h = snaps[t]
    print(f"HV={HV} H={H} K={K} V={V} same run:\n  " + "\n  ".join(res))
