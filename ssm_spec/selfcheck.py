"""Self-check: every op against the token-by-token reference on fresh random data.

Run as ``ssm-spec selfcheck`` (or ``python -m ssm_spec selfcheck``). Prints one table row per
(op, device, state dtype) and exits non-zero if any check fails. Runs on the CPU kernels and,
when CUDA is present, on the Triton kernels. Every registered ``torch.ops.ssm_spec`` op is
checked: the ones with no reference of their own against the ops they are defined by
(``gdn_folded_verify`` == ``gdn_commit`` then ``gdn_verify``, the functional verify ops == the
in-place ones, bit for bit); an op registered without a check here is a failed row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import ops, reference


@dataclass
class Check:
    op: str
    device: str
    state_dtype: str
    what: str
    value: str
    ok: bool



def _window_inputs(T, H, HV, K, V, gen, device):
    """Fresh GDN window inputs: ``q, k [T, H, K]`` and ``v [T, HV, V]`` as strided views of one
    conv-output-like buffer, an fp32 log decay ``g`` and ``beta [T, HV]``."""
    buf = torch.randn(T, 2 * H * K + HV * V, generator=gen).to(device)
    q = buf[:, : H * K].unflatten(1, (H, K))
    k = buf[:, H * K : 2 * H * K].unflatten(1, (H, K))
    v = buf[:, 2 * H * K :].unflatten(1, (HV, V))
    g = (-torch.nn.functional.softplus(torch.randn(T, HV, generator=gen))).to(device)
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen)).to(device)
    return q, k, v, g, beta

def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _gdn_checks(device, state_dtype, seed) -> list[Check]:
    gen = torch.Generator().manual_seed(seed)
    HV, H, K, V, W, S = 8, 4, 64, 48, 4, 16
    lengths = [W, 3, W, 0, W]
    srcs = [0, 5, -1, 7, 9]
    qsl_l = [0]
    for n in lengths:
        qsl_l.append(qsl_l[-1] + n)
    T = qsl_l[-1]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    q, k, v, g, beta = _window_inputs(T, H, HV, K, V, gen, device)
    pool = (torch.randn(S, HV, K, V, generator=gen) * 0.5).to(device=device, dtype=state_dtype)
    qsl, src = i32(qsl_l), i32(srcs)
    sd = str(state_dtype).replace("torch.", "")
    dev = device.type
    checks = []

    before = pool.clone()
    out, rec = ops.gdn_verify(q, k, v, g, beta, pool, src, qsl)
    worst = 0.0
    for b, s in enumerate(srcs):
        bos, eos = qsl_l[b], qsl_l[b + 1]
        if s < 0 or bos == eos:
            continue
        ref = reference.gdn_native_step(q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos],
                                        beta[bos:eos], pool[s], dtype=torch.float64)
        worst = max(worst, _rel(out[bos:eos], ref.out), _rel(rec.u[bos:eos], ref.u))
    checks.append(Check("gdn_verify", dev, sd, "max rel err vs float64 (out, u)", f"{worst:.1e}", worst < 1e-5))
    checks.append(Check("gdn_verify", dev, sd, "pool unchanged", str(torch.equal(pool, before)),
                        torch.equal(pool, before)))

    scratch = torch.cat([pool, torch.zeros((T, HV, K, V), dtype=state_dtype, device=device)])
    snap_out = ops.gdn_snapshot_verify(q, k, v, g, beta, scratch, src, qsl,
                                       torch.arange(S, S + T, dtype=torch.int32, device=device))
    live = torch.tensor([s >= 0 for b, s in enumerate(srcs) for _ in range(lengths[b])])
    same_out = torch.equal(snap_out[live], out[live])
    checks.append(Check("gdn_snapshot_verify", dev, sd, "out == verify out (bitwise)", str(same_out), same_out))

    exact, worst = True, 0.0
    for trial in range(W + 1):
        counts = [min((b + trial) % (W + 1), lengths[b]) for b in range(len(srcs))]
        work = pool.clone()
        ops.gdn_commit(work, rec, qsl, src, i32(counts))
        for b, s in enumerate(srcs):
            if s < 0:
                continue
            n = counts[b]
            native = scratch[S + qsl_l[b] + n - 1] if n else pool[s]
            exact &= torch.equal(work[s], native)
            if n and state_dtype == torch.float32:
                ref = reference.gdn_native_step(q[qsl_l[b]:qsl_l[b] + n], k[qsl_l[b]:qsl_l[b] + n],
                                                v[qsl_l[b]:qsl_l[b] + n], g[qsl_l[b]:qsl_l[b] + n],
                                                beta[qsl_l[b]:qsl_l[b] + n], pool[s], dtype=torch.float64)
                worst = max(worst, _rel(work[s], ref.states[-1]))
    checks.append(Check("gdn_commit", dev, sd, "== native state, every n in 0..W (bitwise)", str(exact), exact))
    if state_dtype == torch.float32:
        checks.append(Check("gdn_commit", dev, sd, "max rel err vs float64", f"{worst:.1e}", worst < 1e-5))

    # the functional form: the same outputs as gdn_verify on the live rows, allocated by the op
    f_out, *f_rec = torch.ops.ssm_spec.gdn_verify_functional(q, k, v, g, beta, pool, src, qsl, K ** -0.5, True)
    same = torch.equal(f_out[live], out[live]) and all(torch.equal(a[live], b[live]) for a, b in zip(f_rec, rec))
    checks.append(Check("gdn_verify_functional", dev, sd, "== verify (out, record; bitwise)", str(same), same))

    # the previous window (the record above) committed and the next window verified in one call
    q2, k2, v2, g2, beta2 = _window_inputs(T, H, HV, K, V, gen, device)
    counts = i32([min(b + 1, n) if s >= 0 else 0 for b, (n, s) in enumerate(zip(lengths, srcs))])
    separate = pool.clone()
    ops.gdn_commit(separate, rec, qsl, src, counts)
    out_s, rec_s = ops.gdn_verify(q2, k2, v2, g2, beta2, separate, src, qsl)
    folded = pool.clone()
    out_f, rec_f = ops.gdn_folded_verify(q2, k2, v2, g2, beta2, folded, src, qsl, rec, qsl[:-1].clone(), counts)
    same = (torch.equal(folded, separate) and torch.equal(out_f[live], out_s[live])
            and all(torch.equal(a[live], b[live]) for a, b in zip(rec_f, rec_s)))
    checks.append(Check("gdn_folded_verify", dev, sd, "== commit then verify (pool, out, record; bitwise)",
                        str(same), same))
    checks += _fast_checks(device, state_dtype, q, k, v, g, beta, q2, k2, v2, g2, beta2, pool, src, qsl, qsl_l,
                           lengths, srcs, counts, live)
    return checks


def _fast_checks(device, state_dtype, q, k, v, g, beta, q2, k2, v2, g2, beta2, pool, src, qsl, qsl_l, lengths,
                 srcs, counts, live) -> list[Check]:
    """Fast mode (docs/design.md section 2.6): the closed-form verify against float64 and the
    exact kernel's own error; its lazy folded form after a first window: the record ring's
    history path (max_pending 8) and the fold path (max_pending 1) against float64."""
    from .ops.gdn.closed_form import RecordRing, ring_positions

    sd, dev = str(state_dtype).replace("torch.", ""), device.type
    HV, K, V = pool.shape[1:]
    H = q.shape[1]
    checks = []
    out_e, _ = ops.gdn_verify(q, k, v, g, beta, pool, src, qsl)
    out_f, rec_f = ops.gdn_closed_form_verify(q, k, v, g, beta, pool, src, qsl, max_window=4)
    err_e = err_f = 0.0
    for b, s in enumerate(srcs):
        bos, eos = qsl_l[b], qsl_l[b + 1]
        if s < 0 or bos == eos:
            continue
        ref = reference.gdn_native_step(q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], pool[s],
                                        dtype=torch.float64)
        err_e, err_f = max(err_e, _rel(out_e[bos:eos], ref.out)), max(err_f, _rel(out_f[bos:eos], ref.out))
    checks.append(Check("gdn_closed_form_verify", dev, sd, "max rel err vs float64 <= 4x exact verify's",
                        f"{err_f:.1e}", err_f <= 4 * max(err_e, 1.2e-7)))
    # lazy: window 1 from the checkpoint, its accepted tokens pending, window 2 with them as a
    # history (max_pending 8) or folded first (max_pending 1)
    worst = {1: 0.0, 8: 0.0}
    for L in worst:
        work = pool.clone()
        ring = RecordRing.zeros(pool.shape[0], ring_positions(L, 4), H, HV, K, V, device)
        zero = torch.zeros_like(counts)
        ops.gdn_closed_form_folded_verify(q, k, v, g, beta, work, src, qsl, ring, zero, zero, L, max_window=4)
        out2 = ops.gdn_closed_form_folded_verify(q2, k2, v2, g2, beta2, work, src, qsl, ring, zero, counts, L,
                                                 max_window=4)
        for b, s in enumerate(srcs):
            bos, eos, n = qsl_l[b], qsl_l[b + 1], int(counts[b])
            if s < 0 or bos == eos:
                continue
            cat = [torch.cat([x[bos:bos + n], y[bos:eos]]) for x, y in zip((q, k, v, g, beta), (q2, k2, v2, g2, beta2))]
            ref = reference.gdn_native_step(*cat, pool[s], dtype=torch.float64)
            worst[L] = max(worst[L], _rel(out2[bos:eos], ref.out[n:]))
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    checks.append(Check("gdn_closed_form_folded_verify", dev, sd, "max rel err vs float64 (history; fold)",
                        f"{worst[8]:.1e}; {worst[1]:.1e}", max(worst.values()) < tol))
    return checks


def _conv_checks(device, seed) -> list[Check]:
    gen = torch.Generator().manual_seed(seed)
    C, ks, dil, S, W = 96, 4, 2, 8, 5
    lc = (ks - 1) * dil
    lengths, srcs = [W, 2, W], [0, 3, 6]
    qsl_l = [0, W, W + 2, 2 * W + 2]
    T = qsl_l[-1]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    x = torch.randn(T, C, generator=gen).to(device)
    w = torch.randn(C, ks, generator=gen).to(device)
    bias = torch.randn(C, generator=gen).to(device)
    state = torch.randn(S, lc, C, generator=gen).to(device)
    out, rec_x = ops.short_conv_verify(x, w, bias, state, i32(srcs), i32(qsl_l), dilation=dil)
    worst = 0.0
    for b, s in enumerate(srcs):
        ref = reference.short_conv_native_step(x[qsl_l[b]:qsl_l[b + 1]], w, bias, state[s], dil,
                                               dtype=torch.float64)
        worst = max(worst, _rel(out[qsl_l[b]:qsl_l[b + 1]], ref.out))
    dev = device.type
    checks = [Check("short_conv_verify", dev, "float32", "max rel err vs float64", f"{worst:.1e}", worst < 1e-6)]
    f_out, f_rec = torch.ops.ssm_spec.short_conv_verify_functional(x, w, bias, state, i32(srcs), i32(qsl_l), dil, "silu")
    same = torch.equal(f_out, out) and torch.equal(f_rec, rec_x)
    checks.append(Check("short_conv_verify_functional", dev, "float32", "== verify (out, record; bitwise)", str(same),
                        same))
    exact = True
    for n_all in range(W + 1):
        counts = [min(n_all, n) for n in lengths]
        work = state.clone()
        ops.short_conv_commit(work, rec_x, i32(qsl_l), i32(srcs), i32(counts))
        for b, s in enumerate(srcs):
            hist = torch.cat([state[s], x[qsl_l[b]:qsl_l[b] + counts[b]]])
            exact &= torch.equal(work[s], hist[-lc:])
    checks.append(Check("short_conv_commit", dev, "float32", "== last Lc inputs, every n (bitwise)", str(exact), exact))
    return checks


def registered_ops() -> list[str]:
    """The names of every registered ``torch.ops.ssm_spec`` op (importing :mod:`ssm_spec.ops`
    registers them)."""
    return sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("ssm_spec::"))


def run(seed: int | None = None) -> list[Check]:
    """Run every check on the CPU and, if present, on CUDA; return the rows (a failed row per
    registered op that no check covers)."""
    seed = int(time.time()) % 100000 if seed is None else seed
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows: list[Check] = []
    for device in devices:
        for state_dtype in (torch.float32, torch.bfloat16):
            rows += _gdn_checks(device, state_dtype, seed)
        rows += _conv_checks(device, seed)
    covered = {r.op for r in rows}
    rows += [Check(op, "-", "-", "registered but not checked by the self-check", "missing", False)
             for op in registered_ops() if op not in covered]
    return rows


def main(seed: int | None = None) -> int:
    """Print the table; return 0 if every check passed, 1 otherwise."""
    seed = int(time.time()) % 100000 if seed is None else seed
    rows = run(seed)
    headers = ("op", "device", "state", "check", "value", "ok")
    table = [(r.op, r.device, r.state_dtype, r.what, r.value, "PASS" if r.ok else "FAIL") for r in rows]
    widths = [max(len(h), *(len(str(row[i])) for row in table)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(f"ssm-spec self-check (seed {seed}, torch {torch.__version__})")
    print(line(headers))
    print(line("-" * w for w in widths))
    for row in table:
        print(line(row))
    failed = sum(not r.ok for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0
