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


def run_cli(argv, *, env: dict | None = None, omp_threads: str | None = "1"):
    """``ssm-spec ARGV`` (``ssm_spec.cli.main``) in the test process, as ``python -m ssm_spec``
    would run it: stdout and stderr captured (neither a terminal), warnings and transformers'
    log printed to that stderr, ``env`` set for the call, and what the command sets process-wide
    (transformers' verbosity and progress bars; torch's threads, which its ``main`` restores)
    put back afterwards. A fresh process would start torch with ``$OMP_NUM_THREADS`` threads
    (``omp_threads``; None: unset, torch's default of one a core, at least 2 here so that a
    command that fails to choose shows it): the call starts with that count.

    Returns an object with ``returncode``, ``stdout`` and ``stderr``, as ``subprocess.run``'s.
    Tests of the process itself (imports, a closed stdout, the console entry) start one instead.
    """
    import contextlib
    import io
    import logging
    import os
    import sys
    import warnings
    from types import SimpleNamespace

    from ssm_spec import cli

    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in [*(env or {}), "OMP_NUM_THREADS"]}
    threads = torch.get_num_threads()
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None
    if hf_logging is not None:
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        handlers = [h for h in hf_logging._get_library_root_logger().handlers if isinstance(h, logging.StreamHandler)]
        streams = [h.stream for h in handlers]
    for key, value in (env or {}).items():
        os.environ[key] = value
    if omp_threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)
        torch.set_num_threads(max(2, os.cpu_count() or 1))
    else:
        os.environ["OMP_NUM_THREADS"] = omp_threads
        torch.set_num_threads(int(omp_threads))
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.resetwarnings()  # a fresh interpreter's filters: shown once per place, deprecations hidden
            warnings.simplefilter("default")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)  # in front of "default"
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
                warnings.formatwarning(message, category, filename, lineno, line))
            if hf_logging is not None:
                for h in handlers:
                    h.setStream(err)
            try:
                code = cli.main(list(map(str, argv)))
            except SystemExit as exc:  # argparse's usage errors and --help
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if hf_logging is not None:
            for h, stream in zip(handlers, streams):
                h.setStream(stream)
            hf_logging.set_verbosity(verbosity)
            (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(threads)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def widen_prompts(monkeypatch, extra: int) -> None:
    """Make the decode loop run every prompt ``extra`` columns wider (more left padding), as it
    does under CUDA graphs to share a captured prefill, on any device: patches the one function
    both the loop's run and ``generate``'s buffer capacity ask, so the capacity grows with it."""
    from ssm_spec.hf import loop
    from ssm_spec.hf.loop import runner

    def wider(prompt_columns: int, graphs: bool) -> int:
        return int(prompt_columns) + extra

    monkeypatch.setattr(runner, "prompt_width", wider)
    monkeypatch.setattr(loop, "prompt_width", wider)

