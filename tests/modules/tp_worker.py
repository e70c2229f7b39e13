"""The per-rank body of the tensor-parallel tests (``tests/modules/test_tensor_parallel.py``), in its
own module so ``spawn``-started processes can import it.

Every entry point takes ``(rank, world, port, arg, result_dir, backend="gloo")``: ``gloo`` runs
on the CPU, ``nccl`` on ``cuda:<rank>`` with fp32 exactness settings (TF32 off, IEEE fp32 dots
in Triton)."""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist


def _layers(device, tp_group=None):
    from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv
    from tests.helpers import randomize_

    torch.manual_seed(0)
    layers = [RecoverGatedDeltaNet(32, 4, 8, 16, 16, device=device),
              RecoverGatedDeltaNet(32, 4, 8, 16, 16, layout="qwen3_5", device=device),
              RecoverShortConv(32, 3, dilation=2, device=device)]
    randomize_(layers, 0.3)
    if tp_group is not None:
        layers = [layer.shard_(tp_group) for layer in layers]
    return layers


def _ops_bitwise(rank: int, world: int, steps: int, device="cpu") -> bool:
    """This rank's heads through verify + commit (the ops a sharded layer runs, no communication)
    against the same ops on every head: ``steps`` steps of random windows and accepted counts;
    the rank's states equal the matching heads of the unsharded pool bit for bit."""
    from ssm_spec import ops
    from tests.helpers import gdn_inputs, qsl_from_lengths, random_pool

    HV, H, K, V = 8, 4, 16, 16
    hv, h = HV // world, H // world
    gen = torch.Generator().manual_seed(2)
    full = random_pool(4, HV, K, V, device, gen=gen)
    mine = full[:, rank * hv:(rank + 1) * hv].clone()
    src = torch.tensor([3, -1, 0], dtype=torch.int32, device=device)
    same = True
    for _ in range(steps):
        lens = [int(torch.randint(1, 5, (), generator=gen)) for _ in range(3)]
        qsl = qsl_from_lengths(lens, device)
        inp = gdn_inputs(int(qsl[-1]), H, HV, K, V, device, gen=gen)
        n = torch.tensor([int(torch.randint(0, L + 1, (), generator=gen)) for L in lens], dtype=torch.int32,
                         device=device)
        out_f, rec_f = ops.gdn_verify(*inp.args(), full, src, qsl)
        sl = (inp.q[:, rank * h:(rank + 1) * h], inp.k[:, rank * h:(rank + 1) * h], inp.v[:, rank * hv:(rank + 1) * hv],
              inp.g[:, rank * hv:(rank + 1) * hv], inp.beta[:, rank * hv:(rank + 1) * hv])
        out_s, rec_s = ops.gdn_verify(*sl, mine, src, qsl)
        live = int(qsl[1])  # row 0's tokens (row 1 pads)
        same &= torch.equal(out_f[:live, rank * hv:(rank + 1) * hv], out_s[:live])
        ops.gdn_commit(full, rec_f, qsl, src, n)
        ops.gdn_commit(mine, rec_s, qsl, src, n)
        same &= torch.equal(full[:, rank * hv:(rank + 1) * hv], mine)
    return bool(same)


def _as_rank(rank: int, world: int, port: int, path: str, body, backend: str = "gloo") -> None:
    """Join a ``backend`` group on loopback, run ``body(device)`` (``cpu`` for gloo, ``cuda:<rank>``
    for NCCL) and write its line (or the traceback) to ``path``; leave the group whatever happens.

    NCCL ranks turn cuDNN / cuBLAS TF32 off and ask Triton for IEEE fp32 dots (unless the
    environment already says otherwise), as ``tests/conftest.py`` does for one process."""
    import ssm_spec  # noqa: F401  before the group: dynamo imported after it holds the group (docs/multi-gpu.md)

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        line = body(device)
    except Exception:
        line = "error\n" + traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(path, "w") as f:
        f.write(line + "\n")


def stack_run(rank: int, world: int, port: int, steps: int, result_dir: str, backend: str = "gloo") -> None:
    """Every rank runs the full stack (the single-process reference) and its own shard on the
    same inputs for ``steps`` steps with random windows and accepted counts (same seeds on every
    rank), and writes what it found to ``result_dir/rank<r>.txt``."""
    _as_rank(rank, world, port, os.path.join(result_dir, f"rank{rank}.txt"),
             lambda dev: _stack(rank, world, steps, dev), backend)


def _stack(rank: int, world: int, steps: int, device="cpu") -> str:
    from ssm_spec import RecoverSSMMetadata, StatePool, commit

    group = dist.group.WORLD
    full, shard = _layers(device), _layers(device, group)
    pools = [StatePool(layers, num_slots=6, max_tokens=32, device=device) for layers in (full, shard)]
    gen = torch.Generator().manual_seed(1)
    worst, done = 0.0, {1: 0, 4: 0}
    for step in range(steps):
        prefill = step == 0
        lens = [7, 5] if prefill else [int(torch.randint(1, 5, (), generator=gen)) for _ in range(2)]
        md = RecoverSSMMetadata.build(lens, [prefill] * 2, [done[4], done[1]], [4, 1], num_slots=6, device=device)
        x = torch.randn(sum(lens), 32, generator=gen).to(device)
        with torch.no_grad():  # every layer on the step's input: the same inputs per layer
            ys = [[layer(x, md, pool) for layer in layers] for layers, pool in zip((full, shard), pools)]
        for a, b in zip(*ys):
            worst = max(worst, ((a - b).norm() / a.norm()).item())
        n = lens if prefill else [int(torch.randint(0, L + 1, (), generator=gen)) for L in lens]
        for pool in pools:
            commit(pool, md, torch.tensor(n, dtype=torch.int32, device=device))
        for s, c in zip([4, 1], n):
            done[s] += c
    # states: within fp32 rounding of the unsharded pool's matching heads and channels (the
    # projections' BLAS calls differ with the output width: 8 vs 16 rows of in_proj_ba
    # round differently on the CPU, so module-level states cannot be bitwise)
    state_err = 0.0
    for layer_f, layer_s in zip(full, shard):
        pairs = []
        if hasattr(layer_s, "num_v_heads"):
            v0, hv = rank * layer_s.num_v_heads, layer_s.num_v_heads
            pairs.append((pools[0].gdn_state(layer_f)[:, v0:v0 + hv], pools[1].gdn_state(layer_s)))
            H, K, V = layer_f.num_k_heads, layer_f.head_k_dim, layer_f.head_v_dim
            h0, hl = rank * layer_s.num_k_heads, layer_s.num_k_heads
            rows = torch.cat([torch.arange(h0 * K, (h0 + hl) * K), H * K + torch.arange(h0 * K, (h0 + hl) * K),
                              2 * H * K + torch.arange(v0 * V, (v0 + hv) * V)]).to(device)
            pairs.append((pools[0].conv_state(layer_f)[..., rows], pools[1].conv_state(layer_s)))
        else:
            c0 = rank * layer_s.channels
            pairs.append((pools[0].conv_state(layer_f)[..., c0:c0 + layer_s.channels], pools[1].conv_state(layer_s)))
        for a, b in pairs:
            state_err = max(state_err, ((a - b).norm() / a.norm().clamp_min(1e-30)).item())
    same = _ops_bitwise(rank, world, steps, device)
    worst = max(worst, state_err)
    return f"ok {worst:.3e} {int(same)}"


def hf_run(rank: int, world: int, port: int, kind: str, result_dir: str, backend: str = "gloo") -> None:
    """A converted tiny model with its GDN layers sharded over the group: greedy prompt lookup
    on every rank equals the unconverted model's plain greedy (a single-process run)."""
    _as_rank(rank, world, port, os.path.join(result_dir, f"hf{rank}.txt"), lambda dev: _hf(kind, dev), backend)


def _hf(kind: str, device="cpu") -> str:
    from ssm_spec.hf import apply_recoverssm, tiny_model
    from ssm_spec.hf.kernels import hf_reference_kernels

    ids = torch.tensor([list(b"def add(x, y):\n    return x + y\n\ndef add(x, y):\n    return")], device=device)
    with hf_reference_kernels():  # the unconverted model on transformers' PyTorch functions (fla-core's differ)
        want = tiny_model(kind, seed=0).to(device).generate(ids, max_new_tokens=48, do_sample=False)
        model = apply_recoverssm(tiny_model(kind, seed=0).to(device), tp_group=dist.group.WORLD)
        layer = next(m for m in model.modules() if hasattr(m, "engine_forward"))
        got = model.generate(ids, max_new_tokens=48, do_sample=False, prompt_lookup_num_tokens=3)
    return f"ok {int(torch.equal(got, want))} {layer.num_v_heads}"


def sleep_run(rank: int, world: int, port: int, seconds: float, result_dir: str, backend: str = "gloo") -> None:
    """A rank that hangs for ``seconds`` (no group): the test of ``_spawn``'s time bound."""
    time.sleep(seconds)
