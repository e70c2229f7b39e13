"""Tensor parallelism in the modules over gloo (CPU processes on loopback, bounded in time):
a sharded stack's verify + commit equals the single-process stack (docs/design.md section 5.9).
The ``gpu`` tests run the same comparisons over NCCL, one GPU per rank (skipped with fewer GPUs
than ranks), and the sharded ``DecoderStack``'s captured step against its eager step."""

import multiprocessing as mp
import socket
import time

import pytest
import torch
import torch.distributed as dist

from tests.modules import tp_stack_worker, tp_worker

TIMEOUT_S = 240


def _gpus(world: int):
    """Marks of a test over ``world`` NCCL ranks: ``gpu``, skipped with fewer GPUs."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs {world} CUDA devices")]


BACKENDS = [pytest.param("gloo", 2, id="gloo-2"), pytest.param("gloo", 4, id="gloo-4"),
            pytest.param("nccl", 2, id="nccl-2", marks=_gpus(2)), pytest.param("nccl", 4, id="nccl-4", marks=_gpus(4))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, steps, tmp_path, target=None, arg=None, prefix="rank", backend="gloo"):
    ctx = mp.get_context("spawn")
    port = _free_port()
    target = target or tp_worker.stack_run
    procs = [ctx.Process(target=target, args=(r, world, port, steps if arg is None else arg, str(tmp_path), backend))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S  # for the whole group: a join per rank would wait world x TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
        p.join(10)
    assert not alive, f"{len(alive)} rank(s) did not finish in {TIMEOUT_S} s"
    return [(tmp_path / f"{prefix}{r}.txt").read_text() for r in range(world)]


@pytest.mark.parametrize("backend, world", BACKENDS)
def test_sharded_stack_equals_the_single_process_stack(backend, world, tmp_path):
    """64 steps (a prefill, then verify windows of 1..4 tokens with random accepted counts, both
    GDN layouts and a short conv): outputs and every rank's recurrent and conv states within
    fp32 rounding of the unsharded layers' (matching heads and channels; the CPU's BLAS rounds a
    projection's rows differently with the output width, so module-level bits cannot match);
    and the ops on each rank's heads (verify + commit, 64 steps) equal the unsharded ops' on those
    heads bit for bit: a shard needs no communication to stay exact."""
    for r, text in enumerate(_spawn(world, 64, tmp_path, backend=backend)):
        assert text.startswith("ok"), f"rank {r}:\n{text}"
        _, err, same = text.split("\n")[0].split()
        assert float(err) < 1e-5 and same == "1", (r, text)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=_gpus(2))])
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_hf_model_with_sharded_gdn_layers_generates_plain_greedys_tokens(kind, backend, tmp_path):
    """``apply_recoverssm(model, tp_group=...)`` on 2 ranks: every rank's greedy prompt lookup
    equals the unconverted model's plain greedy (48 tokens), each rank holding half the heads."""
    pytest.importorskip("transformers")
    for r, text in enumerate(_spawn(2, None, tmp_path, target=tp_worker.hf_run, arg=kind, prefix="hf",
                                    backend=backend)):
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


def test_a_converted_model_refuses_a_tp_group_and_keeps_its_layers(tmp_path):
    """``apply_recoverssm(model, tp_group=...)`` on a model converted without one: a
    ``ValueError`` (sharding happens on the first conversion), not a silent no-op that leaves
    every rank holding every head; the layers are untouched."""
    from ssm_spec.hf import apply_recoverssm, tiny_model

    model = apply_recoverssm(tiny_model("qwen3_next", seed=0))
    layers = [m for m in model.modules() if type(m).__name__ == "RecoverGDNAdapter"]
    heads = [layer.num_v_heads for layer in layers]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already converted"):
            apply_recoverssm(model, tp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert [m for m in model.modules() if type(m).__name__ == "RecoverGDNAdapter"] == layers
    assert [layer.num_v_heads for layer in layers] == heads and all(h > 1 for h in heads)


@pytest.mark.parametrize("backend, world", [BACKENDS[0], BACKENDS[2], BACKENDS[3]])
def test_sharded_decoder_stack_decodes_like_the_unsharded_stack(backend, world, tmp_path):
    """``DecoderStack.shard_`` (GDN heads, attention query / KV heads, MLP width; three
    all-reduces per block): 12 spec-decode steps (k = 3, 4 rows, drafts on the greedy path with
    30% of them wrong) through the graphs runner's eager body, with 2 KV heads (split) and 1 KV
    head (replicated over the ranks): logits, GDN / conv states and KV buffers within fp32
    rounding of the unsharded stack's matching shares, the accepted tokens equal to the
    unsharded stack's on every rank, and the ranks' tokens equal to each other. Some drafts are
    accepted (the windows exercise multi-token commits)."""
    for r, text in enumerate(_spawn(world, 12, tmp_path, target=tp_stack_worker.decoder_stack_run, prefix="stack",
                                    backend=backend)):
        assert text.startswith("ok"), f"rank {r}:\n{text}"
        _, err, same, agree, accepted = text.split()
        assert float(err) < 1e-4 and same == "1" and agree == "1", (r, text)
        assert int(accepted) > 0, (r, text)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch", [1, 4])
def test_sharded_decoder_stack_capture_replays_its_eager_step_bit_for_bit(world, batch, tmp_path):
    """GPU: the sharded stack's step captured as a CUDA graph (the NCCL all-reduces inside)
    replays to the same accepted tokens, counts, states and KV buffers as its eager step on the
    same buffers, bit for bit, on every rank."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    for r, text in enumerate(_spawn(world, None, tmp_path, target=tp_stack_worker.capture_run, arg=batch,
                                    prefix="capture", backend="nccl")):
        assert text.startswith("ok"), f"rank {r}:\n{text}"
        assert text.split() == ["ok", "1", "1"], (r, text)


def test_decoder_stack_widths_not_divisible_by_the_tp_size_raise(tmp_path):
    """Query heads, KV heads (neither dividing nor divided by the size), MLP width, GDN heads:
    each a ``ValueError`` naming the width; a stack sharded twice is refused."""
    from ssm_spec.graphs.stack import DecoderStack
    import ssm_spec.modules.tensor_parallel as tp

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    orig = tp.dist.get_world_size, tp.dist.get_rank
    try:
        fake = type("Group", (), {})()
        tp.dist.get_world_size, tp.dist.get_rank = (lambda g=None: 3), (lambda g=None: 0)
        base = dict(vocab_size=16, hidden_size=24, num_layers=4, intermediate_size=48, num_k_heads=3,
                    num_v_heads=6, head_k_dim=8, head_v_dim=8, num_heads=6, num_kv_heads=3, head_dim=4, max_len=8)
        for change, match in [({"num_heads": 4, "num_kv_heads": 2}, "num_heads=4 is not divisible"),
                              ({"num_kv_heads": 2}, "num_kv_heads=2 is neither divisible by nor a divisor"),
                              ({"intermediate_size": 32}, "intermediate_size=32 is not divisible"),
                              ({"num_k_heads": 2, "num_v_heads": 4}, "num_k_heads=2 is not divisible")]:
            with pytest.raises(ValueError, match=match):
                DecoderStack(**{**base, **change}, tp_group=fake)
            full = DecoderStack(**{**base, **change})  # refused as a whole: no layer cut before the error
            widths = [p.shape for p in full.parameters()]
            with pytest.raises(ValueError, match=match):
                full.shard_(fake)
            assert [p.shape for p in full.parameters()] == widths and full.tp_group is None
        part = DecoderStack(**base)  # one GDN layer sharded by hand: the stack refuses, cutting nothing
        part.mixers[2].shard_(fake)
        widths = [p.shape for p in part.parameters()]
        with pytest.raises(ValueError, match="already sharded"):
            part.shard_(fake)
        assert [p.shape for p in part.parameters()] == widths and part.mixers[0].tp_group is None
        stack = DecoderStack(**base, tp_group=fake)  # everything divisible by 3
        assert stack.mixers[3].num_heads == 2 and stack.mixers[3].num_kv_heads == 1
        assert stack.mlps[0].gate_proj.out_features == 16 and stack.mlps[0].down_proj.in_features == 16
        with pytest.raises(ValueError, match="already sharded"):
            stack.shard_(fake)
        tp.dist.get_world_size = lambda g=None: 6  # 3 KV heads over 6 ranks: each keeps one, replicated
        stack = DecoderStack(**{**base, "num_heads": 12, "intermediate_size": 48, "num_k_heads": 6,
                                "num_v_heads": 6}, tp_group=fake)
        assert stack.mixers[3].num_heads == 2 and stack.mixers[3].num_kv_heads == 1
        assert stack.mixers[3].kv.shape[3] == 1
    finally:
        tp.dist.get_world_size, tp.dist.get_rank = orig
        dist.destroy_process_group()


def test_a_hung_group_is_given_up_after_the_timeout_in_all(tmp_path):
    """Every rank stuck (a collective that never completes): ``_spawn`` gives the group up after
    ``TIMEOUT_S`` in all, not ``TIMEOUT_S`` per rank (3 ranks: 3x as long), so one hung NCCL test
    cannot eat the GPU run's time several times over."""
    global TIMEOUT_S
    saved, TIMEOUT_S = TIMEOUT_S, 4
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="3 rank"):
            _spawn(3, None, tmp_path, target=tp_worker.sleep_run, arg=120)
        elapsed = time.monotonic() - t0
    finally:
        TIMEOUT_S = saved
    assert elapsed < 9, elapsed
