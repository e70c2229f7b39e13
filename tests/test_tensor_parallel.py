"""Tensor parallelism in the modules over gloo (CPU processes on loopback, bounded in time):
a sharded stack's verify + commit equals the single-process stack (docs/design.md section 5.9)."""

import multiprocessing as mp
import socket

import pytest
import torch
import torch.distributed as dist

from tests import tp_worker

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, steps, tmp_path, target=None, arg=None, prefix="rank"):
    ctx = mp.get_context("spawn")
    port = _free_port()
    target = target or tp_worker.stack_run
    procs = [ctx.Process(target=target, args=(r, world, port, steps if arg is None else arg, str(tmp_path)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    assert not alive, f"{len(alive)} rank(s) did not finish in {TIMEOUT_S} s"
    return [(tmp_path / f"{prefix}{r}.txt").read_text() for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_stack_equals_the_single_process_stack(world, tmp_path):
    """64 steps (a prefill, then verify windows of 1..4 tokens with random accepted counts, both
    GDN layouts and a short conv): outputs and every rank's recurrent and conv states within
    fp32 rounding of the unsharded layers' (matching heads and channels; the CPU's BLAS rounds a
    projection's rows differently with the output width, so module-level bits cannot match);
    and the ops on each rank's heads (verify + commit, 64 steps) equal the unsharded ops' on those
    heads bit for bit: a shard needs no communication to stay exact."""
    for r, text in enumerate(_spawn(world, 64, tmp_path)):
        assert text.startswith("ok"), f"rank {r}:\n{text}"
        _, err, same = text.split("\n")[0].split()
        assert float(err) < 1e-5 and same == "1", (r, text)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_hf_model_with_sharded_gdn_layers_generates_plain_greedys_tokens(kind, tmp_path):
    """``apply_recoverssm(model, tp_group=...)`` on 2 ranks: every rank's greedy prompt lookup
    equals the unconverted model's plain greedy (48 tokens), each rank holding half the heads."""
    pytest.importorskip("transformers")
    for r, text in enumerate(_spawn(2, None, tmp_path, target=tp_worker.hf_run, arg=kind, prefix="hf")):
        assert text.startswith("ok"), f"rank {r}:\n{text}"
        _, equal, heads = text.split()
        assert equal == "1", (r, text)
    from ssm_spec.hf import tiny_model
    full = next(m for m in tiny_model(kind).modules() if hasattr(m, "num_v_heads"))
    assert int(heads) * 2 == full.num_v_heads


def test_heads_not_divisible_by_the_tp_size_raise(tmp_path):
    from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        fake = type("Group", (), {})()
        import ssm_spec.modules.tensor_parallel as tp

        orig = tp.dist.get_world_size, tp.dist.get_rank
        tp.dist.get_world_size, tp.dist.get_rank = (lambda g=None: 3), (lambda g=None: 0)
        try:
            with pytest.raises(ValueError, match="num_k_heads=4 is not divisible by the tensor-parallel size 3"):
                RecoverGatedDeltaNet(32, 4, 8, 16, 16, tp_group=fake)
            with pytest.raises(ValueError, match="channels=32 is not divisible"):
                RecoverShortConv(32, 3, tp_group=fake)
            with pytest.raises(ValueError, match="num_k_heads"):
                RecoverGatedDeltaNet(32, 4, 8, 16, 16).shard_(fake)
        finally:
            tp.dist.get_world_size, tp.dist.get_rank = orig
        layer = RecoverGatedDeltaNet(32, 4, 8, 16, 16, tp_group=dist.group.WORLD)  # a group of one: all heads
        assert layer.num_k_heads == 4 and layer.out_proj.in_features == 128
        with pytest.raises(ValueError, match="already sharded"):
            layer.shard_(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert torch.ones(1).item() == 1
