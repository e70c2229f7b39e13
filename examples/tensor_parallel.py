"""Tensor-parallel RecoverSSM layers: each rank keeps its share of the heads and its own pool.

Launch one process per rank with torchrun (gloo on CPUs, NCCL on GPUs)::

    torchrun --nproc-per-node 2 examples/tensor_parallel.py            # CPU, gloo
    torchrun --nproc-per-node 4 examples/tensor_parallel.py --device cuda

Every rank builds the same full layers (same seed), keeps its shard (``shard_``: key and value
heads, q/k/v conv channels, the projections' rows, ``out_proj``'s columns; a short conv's
channels), and runs a prefill and 16 spec-decode steps (random windows and accepted counts, the
same on every rank) with verify and commit on its own pool; the GDN output is all-reduced, the
short conv's all-gathered. Each rank also runs the unsharded layers and prints how far apart
the two are (fp32 all-reduce rounding). What is not sharded here: embeddings, attention, MLPs and
the LM head (a model's own tensor parallelism, e.g. transformers' ``tp_plan``, covers those).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

# imported before the process group exists: importing torch._dynamo (which ssm_spec does) after
# init_process_group keeps a reference to the default group that destroy_process_group cannot
# drop, so gloo's worker threads would outlive it into the interpreter's exit
from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    try:
        worst = run(args.steps, rank, world, dev)
    finally:
        # the sharded layers held the group and are gone once run() has returned: this drops its
        # last reference, so gloo's worker threads are joined here. Left to the interpreter's exit, a
        # worker still releasing the last collective's tensors needs the GIL and aborts the
        # process ('terminate called without an active exception'; pytorch/pytorch#190489)
        dist.destroy_process_group()
    return 0 if worst < 1e-4 else 1


def run(steps: int, rank: int, world: int, dev: torch.device) -> float:
    """The prefill and ``steps`` spec-decode steps, sharded and unsharded; returns the largest
    relative difference between the two stacks' outputs."""

    def layers():
        torch.manual_seed(0)
        made = [RecoverGatedDeltaNet(64, 4, 8, 32, 32, device=dev), RecoverShortConv(64, 3, dilation=2, device=dev)]
        with torch.no_grad():
            for layer in made:
                for prm in layer.parameters():
                    prm.normal_(std=0.3)
        return made

    full, shard = layers(), [layer.shard_(dist.group.WORLD) for layer in layers()]
    pools = [StatePool(ls, num_slots=4, max_tokens=16, device=dev) for ls in (full, shard)]
    gen = torch.Generator().manual_seed(1)
    done, worst = [0, 0], 0.0
    for step in range(steps + 1):
        prefill = step == 0
        lens = [9, 6] if prefill else [int(torch.randint(1, 5, (), generator=gen)) for _ in range(2)]
        md = RecoverSSMMetadata.build(lens, [prefill] * 2, done, [0, 3], num_slots=4, device=dev)
        x = torch.randn(sum(lens), 64, generator=gen).to(dev)
        with torch.no_grad():
            outs = []
            for ls, pool in zip((full, shard), pools):
                h = x
                for layer in ls:
                    h = h + layer(h, md, pool)
                outs.append(h)
        worst = max(worst, ((outs[0] - outs[1]).norm() / outs[0].norm()).item())
        n = lens if prefill else [int(torch.randint(0, L + 1, (), generator=gen)) for L in lens]
        for pool in pools:
            commit(pool, md, torch.tensor(n, dtype=torch.int32, device=dev))
        done = [d + c for d, c in zip(done, n)]
    local = shard[0].num_v_heads
    print(f"rank {rank}/{world}: value heads {rank * local}..{(rank + 1) * local - 1} of {full[0].num_v_heads}, "
          f"state {tuple(pools[1].gdn_state(shard[0]).shape)} (unsharded {tuple(pools[0].gdn_state(full[0]).shape)}); "
          f"{steps} steps; max rel diff to the unsharded stack {worst:.2e}")
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
