"""Input builders and comparisons shared by the op tests (CPU, GPU and Triton interpreter)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

I32 = torch.int32
POISON = float("nan")


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=I32, device=device)


# fla-core's chunked prefill (a WY-form solve per 64-token chunk) is not the token loop's
# arithmetic; on these strongly gated random layers it lands within this of the token loop
# (measured on the H200: docs/perf-notes.md, "fla-core prefill").
FLA_PREFILL_TOL = 1e-4


def prefill_uses_fla(device, head_dims) -> bool:
    """Whether prompt rows on ``device`` run through fla-core's chunked prefill (CUDA, fla-core
    installed, every head dim >= 16), so states and outputs compare within FLA_PREFILL_TOL."""
    from ssm_spec.modules import prefill

    return torch.device(device).type == "cuda" and min(head_dims) >= 16 and prefill._fla_chunk() is not None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that also holds for NaN poison."""
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def fenced(pool: torch.Tensor, extra: int = 4):
    """``(buffer, view)``: ``view`` holds ``pool``'s slots and is the first ``S`` slots of a
    larger ``buffer`` whose extra slots are NaN, so an unguarded access past the pool shows."""
    fence = torch.full((extra, *pool.shape[1:]), float("nan"), dtype=pool.dtype, device=pool.device)
    buffer = torch.cat([pool, fence])
    return buffer, buffer[: pool.shape[0]]


def rotating_counts(trial: int, lengths, W: int) -> list[int]:
    """Accepted counts for one trial: over trials ``0..W`` every row sees every count
    ``0..W`` (capped at its window), and rows differ within a trial."""
    return [min((b + trial) % (W + 1), n) for b, n in enumerate(lengths)]


def qsl_from_lengths(lengths, device) -> torch.Tensor:
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return i32(qsl, device)


@dataclass
class GDNInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def window(self, bos, eos):
        return (self.q[bos:eos], self.k[bos:eos], self.v[bos:eos], self.g[bos:eos], self.beta[bos:eos])

    def args(self):
        return (self.q, self.k, self.v, self.g, self.beta)


def gdn_inputs(T, H, HV, K, V, device, dtype=torch.float32, strided=True, gen=None,
               g_fill=None, beta_fill=None) -> GDNInputs:
    """Fresh random GDN activations. ``strided``: q, k, v are views of one conv-output-like
    buffer ``[T, 2*H*K + HV*V]`` (as the module produces them), so none is contiguous."""
    gen = gen or torch.Generator().manual_seed(0)
    if strided:
        buf = torch.randn(T, 2 * H * K + HV * V, generator=gen).to(device=device, dtype=dtype)
        q = buf[:, : H * K].unflatten(1, (H, K))
        k = buf[:, H * K : 2 * H * K].unflatten(1, (H, K))
        v = buf[:, 2 * H * K :].unflatten(1, (HV, V))
    else:
        q = torch.randn(T, H, K, generator=gen).to(device=device, dtype=dtype)
        k = torch.randn(T, H, K, generator=gen).to(device=device, dtype=dtype)
        v = torch.randn(T, HV, V, generator=gen).to(device=device, dtype=dtype)
    a = torch.randn(T, HV, generator=gen)
    g = (-torch.nn.functional.softplus(a) * 0.5).to(device)
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen)).to(device=device, dtype=dtype)
    if g_fill is not None:
        g = torch.full_like(g, g_fill)
    if beta_fill is not None:
        beta = torch.full_like(beta, beta_fill)
    return GDNInputs(q, k, v, g.to(torch.float32), beta)


def random_pool(S, HV, K, V, device, dtype=torch.float32, gen=None) -> torch.Tensor:
    gen = gen or torch.Generator().manual_seed(1)
    return (torch.randn(S, HV, K, V, generator=gen) * 0.5).to(device=device, dtype=dtype)


def native_states(inputs: GDNInputs, state, src, qsl, scale=None, use_qk_l2norm=True):
    """The same backend's native per-token states: run ``gdn_snapshot_verify`` on a scratch
    pool that has one slot per token. Returns ``(out, snaps [T, HV, K, V])``."""
    from ssm_spec import ops

    T = inputs.q.shape[0]
    S = state.shape[0]
    scratch = torch.cat([state, torch.zeros((T, *state.shape[1:]), dtype=state.dtype, device=state.device)])
    snap_idx = torch.arange(S, S + T, dtype=I32, device=state.device)
    out = ops.gdn_snapshot_verify(*inputs.args(), scratch, src, qsl, snap_idx, scale=scale,
                                  use_qk_l2norm=use_qk_l2norm)
    return out, scratch[S:]


def randomize_(layers, std: float):
    """Random weights for a stack of ssm_spec layers (decays in a lively range); returns it."""
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.normal_(std=std)
            if hasattr(layer, "A_log"):
                layer.A_log.uniform_(-1, 1)
    return layers


def run_stack(layers, x, metadata, pool):
    """A residual stack: ``x + layer(x)`` for every layer, without autograd."""
    with torch.no_grad():
        for layer in layers:
            x = x + layer(x, metadata, pool)
    return x


def pool_states(pool) -> list[torch.Tensor]:
    """Copies of every state group of a ``StatePool``: the GDN groups, then the conv groups."""
    return [s.clone() for s, _ in pool.gdn_groups.values()] + [s.clone() for s, _ in pool.conv_groups.values()]


def first_divergence(plain, tokens: torch.Tensor, prompt_len: int):
    """Where greedy ``tokens [1, P + N]`` part from ``plain`` (a ``generate`` output with
    ``output_scores``): ``None`` when the new tokens are equal, else ``(position, top-2 values of
    plain's logits there)``. Asserts the two runs made the same number of new tokens."""
    a, b = plain.sequences[0, prompt_len:], tokens[0, prompt_len:]
    assert a.shape == b.shape
    diff = (a != b).nonzero()
    if not len(diff):
        return None
    p = int(diff[0])
    return p, plain.scores[p][0].float().topk(2).values


def verified_gdn(device, H=2, HV=4, K=8, V=6, S=6):
    """``(inputs, pool, query_start_loc, src, record)``: two rows of three tokens verified from
    slots 0 and 1 of a random pool of ``S`` slots (seed 0), the validation tests' common step."""
    from ssm_spec import ops

    gen = torch.Generator().manual_seed(0)
    inp = gdn_inputs(6, H, HV, K, V, device, gen=gen)
    pool = random_pool(S, HV, K, V, device, gen=gen)
    qsl = qsl_from_lengths([3, 3], device)
    src = i32([0, 1], device)
    _, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    return inp, pool, qsl, src, rec
