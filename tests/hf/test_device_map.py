"""Device maps (docs/design.md section 5.9): a ``StatePool`` groups layers by (device, shape) and
runs every launch once per group on the group's device; a Hugging Face model placed by a
``device_map`` (accelerate hooks, offloaded weights) generates plain greedy's tokens after
``apply_recoverssm``.

On the CPU a pool spread over the CPU and the ``meta`` device stands in for two devices: every
op call is checked to get tensors of one device only (a plan or slot tensor left on the wrong
device fails the test), the meta half computes nothing, and the CPU half must equal, bit for
bit, a pool on the CPU alone. Which device each launch runs under (Triton launches on the
current CUDA device) is checked on the CPU with ``torch.cuda.device`` replaced by a recorder.
The GPU tests (marked ``gpu``) run the same comparison with ``cuda`` as the second device, on
both halves, and split a tiny model over ``cuda:0`` and the CPU; where two GPUs are present,
over ``cuda:1`` (first, while ``cuda:0`` is current) and ``cuda:0``, every launch checked to run
with its tensors' device current.
"""

import contextlib
import functools
from types import SimpleNamespace

import pytest
import torch

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit, pools
from ssm_spec.hf import RecoverSSMCache, apply_recoverssm, cache_kwarg, kept_cache, tiny_model
from ssm_spec.hf.placement import execution_device, layer_devices, placement_problem
from ssm_spec.hf.rollback import RollbackPool
from ssm_spec.hf.tiny import ByteTokenizer
from ssm_spec.ops import _eager
from ssm_spec.pools import ConvStateSpec, GDNStateSpec, group_layers, placement_device
from tests.helpers import i32, randomize_

HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]
TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
CPU, META = torch.device("cpu"), torch.device("meta")
TOK = ByteTokenizer()
PROMPT = "the cat sat on the mat. the cat sat on the"


# ----------------------------------------------------------------------------- grouping keys


def test_placement_device_names_each_device_once():
    """Group keys need no GPU: ``cuda`` without an index is the current device (cuda:0 here
    when CUDA is absent), ``cpu:0`` is ``cpu``, an accelerator index is a CUDA device."""
    cuda0 = torch.device("cuda", torch.cuda.current_device() if HAS_CUDA else 0)
    assert placement_device("cuda") == cuda0 == placement_device(cuda0.index)
    assert placement_device(torch.device("cuda", 1)) == placement_device("cuda:1") == placement_device(1)
    assert placement_device("cpu") == placement_device("cpu:0") == placement_device(torch.device("cpu", 0)) == CPU
    assert placement_device("cuda:1") != placement_device("cuda:0")
    assert placement_device("meta") == META
    with pytest.raises(ValueError, match="device"):
        placement_device(True)
    with pytest.raises(ValueError, match="device"):
        placement_device("gpu7")


class _Fake:
    """A layer for the grouping alone: its ``state_specs()``."""

    def __init__(self, *specs):
        self.specs = specs

    def state_specs(self):
        return list(self.specs)


def test_group_layers_keys_by_device_then_shape():
    """Layers on two devices never share a group, nor do two shapes; groups and their members
    keep the order of first appearance; ``"cuda:1"``, ``1`` and ``torch.device("cuda", 1)`` are
    one device. No GPU needed: only the keys are computed."""
    g1, g2 = GDNStateSpec(4, 2, 16, 16), GDNStateSpec(8, 4, 16, 16)
    c1, c2 = ConvStateSpec(3, 96), ConvStateSpec(3, 192)
    a, b, c, d, e = (_Fake(("gdn", g1), ("conv", c1)), _Fake(("gdn", g1), ("conv", c1)),
                     _Fake(("gdn", g2), ("conv", c2)), _Fake(("gdn", g1), ("conv", c1)), _Fake(("conv", c1)))
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    groups = group_layers([a, b, c, d, e], ["cuda:0", 1, torch.device("cuda", 0), torch.device("cuda", 1), "cpu"])
    assert list(groups) == [("gdn", cuda0, g1), ("conv", cuda0, c1), ("gdn", cuda1, g1), ("conv", cuda1, c1),
                            ("gdn", cuda0, g2), ("conv", cuda0, c2), ("conv", CPU, c1)]
    assert groups["gdn", cuda0, g1] == [a] and groups["gdn", cuda1, g1] == [b, d]
    assert groups["conv", cuda0, c2] == [c] and groups["conv", CPU, c1] == [e]
    # one device: groups by shape alone, as a pool on one device always did
    assert list(group_layers([a, b, c], [CPU] * 3)) == [("gdn", CPU, g1), ("conv", CPU, c1), ("gdn", CPU, g2),
                                                       ("conv", CPU, c2)]
    with pytest.raises(ValueError, match="one per layer"):
        group_layers([a, b], ["cpu"])


def _two_shapes(seed=0):
    """Two GDN shapes (qwen3_next and qwen3_5 layouts) and a short conv, with lively weights."""
    torch.manual_seed(seed)
    return randomize_([RecoverGatedDeltaNet(16, 2, 4, 8, 4, layout="qwen3_next"),
                       RecoverShortConv(16, 3, dilation=2, bias=True),
                       RecoverGatedDeltaNet(16, 1, 2, 8, 8, layout="qwen3_5"),
                       RecoverGatedDeltaNet(16, 2, 4, 8, 4, layout="qwen3_5")], 0.3)


def test_two_shapes_make_two_groups_and_commit_equals_the_per_layer_reference(device):
    """Layers of two GDN shapes (and three conv shapes) make one group per shape; the grouped
    commit (one launch per group) writes what one ungrouped commit per layer writes, bit for bit
    (random states and records, ragged windows, every count, a padding row)."""
    from ssm_spec import ops
    from ssm_spec.ops import ReplayRecord

    layers = [m.to(device) for m in _two_shapes()]
    pool = StatePool(layers, num_slots=6, max_tokens=16, device=device)
    assert len(pool.gdn_groups) == 2 and len(pool.conv_groups) == 3
    assert {d for d, _ in (*pool.gdn_groups, *pool.conv_groups)} == {placement_device(device)}
    gen = torch.Generator().manual_seed(1)
    for state, records in pool.gdn_groups.values():
        state.copy_(torch.randn(state.shape, generator=gen))
        records.u.copy_(torch.randn(records.u.shape, generator=gen))
        records.k.copy_(torch.nn.functional.normalize(torch.randn(records.k.shape, generator=gen), dim=-1))
        records.decay.copy_(-torch.rand(records.decay.shape, generator=gen))
    for state, records in pool.conv_groups.values():
        state.copy_(torch.randn(state.shape, generator=gen))
        records.copy_(torch.randn(records.shape, generator=gen))
    md = RecoverSSMMetadata.build([4, 2, 0, 3], [False] * 4, [5, 1, 0, 7], [4, 0, -1, 2], num_slots=6, device=device)
    n = i32([3, 2, 0, 1], device)
    T = md.verify_stop - md.verify_start
    qsl = md.verify_query_start_loc
    expected = {}
    for layer in layers:
        if isinstance(layer, RecoverGatedDeltaNet):
            state = pool.gdn_state(layer).clone()
            rec = pool.gdn_record(layer, T)
            ops.gdn_commit(state, ReplayRecord(rec.u, rec.k, rec.decay), qsl, md.verify_indices, n)
            expected[id(layer), "gdn"] = state
        conv = pool.conv_state(layer).clone()
        ops.short_conv_commit(conv, pool.conv_record(layer, T), qsl, md.verify_indices, n)
        expected[id(layer), "conv"] = conv
    commit(pool, md, n)
    for layer in layers:
        if isinstance(layer, RecoverGatedDeltaNet):
            assert torch.equal(pool.gdn_state(layer), expected[id(layer), "gdn"])
        assert torch.equal(pool.conv_state(layer), expected[id(layer), "conv"])


# ----------------------------------------------------------------------------- a pool over two devices


@pytest.fixture
def one_device_per_call(monkeypatch):
    """Every op call must get tensors of a single device (a plan or slot tensor on another
    device than its group's fails here, whatever the op's own checks) and, on CUDA, run with
    that device current (Triton launches on the current device); calls on ``meta`` compute
    nothing. Yields the list of ``(op, device)`` calls."""
    real = _eager.call
    calls = []

    def checked(name, *args):
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        assert len(devices) == 1, f"{name} got tensors on {devices}"
        device = args[0].device
        if device.type == "cuda":
            assert torch.cuda.current_device() == device.index, f"{name} on {device} launched with " \
                                                                 f"cuda:{torch.cuda.current_device()} current"
        calls.append((name, device))
        return None if device.type == "meta" else real(name, *args)

    monkeypatch.setattr(_eager, "call", checked)
    return calls


OTHER = [pytest.param("meta", "cpu", id="cpu+meta"), pytest.param("cuda", "cpu", id="cpu+cuda", marks=GPU),
         pytest.param("cuda:1", "cuda:0", id="cuda0+cuda1", marks=TWO_GPUS)]
POOL_MODES = {"exact": {}, "snapshot": dict(snapshot=True), "folded": dict(folded=True), "fast": dict(mode="fast"),
              "lazy": dict(mode="fast", folded=True, max_pending=3)}
W = 4


def _placed(other, first, base="cpu"):
    """Two copies of the stack, one on ``base`` and one on ``other``, interleaved; ``first``:
    which device holds the first layer (and so the pool's bookkeeping and metadata), ``base``
    or ``"other"``."""
    cpu_layers, other_layers = [m.to(base) for m in _two_shapes(0)], [m.to(other) for m in _two_shapes(1)]
    pairs = zip(cpu_layers, other_layers) if first == base else zip(other_layers, cpu_layers)
    layers = [m for pair in pairs for m in pair]
    return layers, [next(m.parameters()).device for m in layers]


def _drive(layers, devices, pool, main, calls=None):
    """Twelve steps on ``pool``: two prompts, verify windows with random acceptance, a request
    admitted at step 5 that verifies from the zero state, a zeroed slot, and for folded pools a
    flush. Every layer gets the same flat input on its own device (no residual chain, so each
    half can be compared alone). Returns the outputs ``{id(layer): [T, 16] per step}``."""
    gen = torch.Generator().manual_seed(7)
    outs = {id(m): [] for m in layers}

    def step(lens, prefill, done, slots):
        md = RecoverSSMMetadata.build(lens, prefill, done, slots, num_slots=4, device=main)
        x = torch.randn(sum(lens), 16, generator=gen)
        with torch.no_grad():
            for layer, device in zip(layers, devices):
                outs[id(layer)].append(layer(x.to(device), md, pool))
        return md

    step([6, 3], [True, True], [0, 0], [1, 3])
    done = {1: 6, 3: 3}
    for k in range(10):
        if k == 5:
            done[0] = 0  # a request admitted into slot 0: verifies from the zero state
        slots = list(done)
        md = step([W] * len(slots), [False] * len(slots), [done[s] for s in slots], slots)
        n = torch.randint(0, W + 1, (len(slots),), generator=gen, dtype=torch.int32)
        before = len(calls) if calls is not None else 0
        commit(pool, md, n.to(main))
        if calls is not None and not pool.folded and not pool.snapshot:  # one launch per group, on its device
            launched = sorted((name, str(d)) for name, d in calls[before:])
            groups = [("gdn_commit", str(d)) for d, _ in pool.gdn_groups] + \
                     [("short_conv_commit", str(d)) for d, _ in pool.conv_groups]
            assert launched == sorted(groups)
        for s_, c in zip(slots, n.tolist()):
            done[s_] += c
    if pool.folded:
        pool.flush()
    pool.zero_slots(i32([3], main))
    return outs


def _current(device):
    """``device`` made current for a pool on it alone (a pool on one device launches on the
    current CUDA device, as any Triton code does); nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _compare_half(layers, devices, half, mixed, mixed_outs, pool_kwargs):
    """The layers on ``half``, run alone on a pool on ``half``, give the mixed pool's bits."""
    mine = [(m, d) for m, d in zip(layers, devices) if d == half]
    alone = StatePool([m for m, _ in mine], num_slots=4, max_tokens=16, device=half, **pool_kwargs)
    with _current(half):
        outs = _drive([m for m, _ in mine], [half] * len(mine), alone, half)
    for m, _ in mine:
        for a, b in zip(mixed_outs[id(m)], outs[id(m)]):
            assert torch.equal(a, b)
        assert torch.equal(mixed.conv_state(m), alone.conv_state(m))
        if isinstance(m, RecoverGatedDeltaNet):
            assert torch.equal(mixed.gdn_state(m), alone.gdn_state(m))


@pytest.mark.parametrize("mode", list(POOL_MODES))
@pytest.mark.parametrize("other,first,base", [
    pytest.param("meta", "cpu", "cpu", id="cpu+meta"),  # meta cannot come first (a ValueError: see below)
    pytest.param("cuda", "cpu", "cpu", id="cpu+cuda", marks=GPU),
    pytest.param("cuda", "other", "cpu", id="cuda+cpu", marks=GPU),
    # the first layer (bookkeeping, metadata) on cuda:1 while cuda:0 is current
    pytest.param("cuda:1", "other", "cuda:0", id="cuda1+cuda0", marks=TWO_GPUS),
])
def test_pool_over_two_devices_equals_a_pool_per_device(one_device_per_call, other, first, base, mode):
    """A stack spread over two devices, every pool mode (exact, snapshot, folded, fast, fast
    folded with the lazy commit): groups by (device, shape), each state on its layer's device,
    every commit launch once per group on its device (on CUDA with that device current), and
    each half's outputs and states equal, bit for bit, the same layers run on a pool of their
    own device. Metadata and accepted counts come from the first layer's device; the others
    read copies."""
    layers, devices = _placed(other, first, base)
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=devices, **POOL_MODES[mode])
    main = devices[0]
    both = {placement_device(base), placement_device(other)}
    assert pool.device == main and set(pool.devices) == both and pool.spread
    assert len(pool.gdn_groups) == 4 and len(pool.conv_groups) == 6  # two GDN shapes, three conv shapes, per device
    for m, d in zip(layers, devices):
        assert pool.conv_state(m).device == d and pool.device_of(m) == d
    outs = _drive(layers, devices, pool, main, one_device_per_call)
    assert {d for _, d in one_device_per_call} == both
    for half in both - {META}:
        _compare_half(layers, devices, half, pool, outs, POOL_MODES[mode])


@pytest.mark.parametrize("other,base", OTHER)
def test_rollback_pool_over_two_devices(one_device_per_call, other, base):
    """The Hugging Face path's pool (checkpoint and scratch slots, pending records, crops,
    row reordering) on two devices: each half equals a rollback pool of its own device; hidden
    states on another device than the layer's states are refused."""
    layers, devices = _placed(other, base, base)
    gen = torch.Generator().manual_seed(3)
    plan = [(7, None), (4, 2), (1, 0), (3, 3), (5, 1)]  # (tokens of a forward, crop after it)
    inputs = [torch.randn(2, L, 16, generator=gen) for L, _ in plan]

    def run(members, devs):
        rb = RollbackPool(members, batch_size=2, max_pending=5, device=devs)
        outs = {id(m): [] for m in members}
        with torch.no_grad():
            for x, (L, crop) in zip(inputs, plan):
                rb.begin_forward(L)
                for m, d in zip(members, devs):
                    outs[id(m)].append(rb.run(m, x.to(d)))
                if crop is not None:
                    rb.crop(crop)
        rb.reorder(torch.tensor([1, 0]))
        return rb, outs

    rb, outs = run(layers, devices)
    both = {placement_device(base), placement_device(other)}
    assert set(rb.pool.devices) == both
    for half in both - {META}:
        mine = [m for m, d in zip(layers, devices) if d == half]
        with _current(half):
            alone, alone_outs = run(mine, [half] * len(mine))
        for m in mine:
            assert all(torch.equal(a, b) for a, b in zip(outs[id(m)], alone_outs[id(m)]))
            assert torch.equal(rb.pool.conv_state(m), alone.pool.conv_state(m))
    rb.begin_forward(1)
    with pytest.raises(ValueError, match="states are on"):
        rb.run(layers[1], torch.zeros(2, 1, 16))  # layers[1] lives on `other`


def test_capture_refuses_a_pool_over_two_devices():
    """The graphs runner and the compiled step hold one device's step: a pool spread over two
    devices is refused with a clear message (run such a model eagerly)."""
    from ssm_spec.graphs import SpecDecodeGraphRunner
    from ssm_spec.graphs.compiled import compile_step

    layers, devices = _placed("meta", "cpu")
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=devices)
    with pytest.raises(ValueError, match="spans cpu, meta"):
        SpecDecodeGraphRunner(None, pool, num_draft_tokens=1, vocab_size=8, buckets=(1,))
    with pytest.raises(ValueError, match="spans cpu, meta"):
        compile_step(None, pool)


def test_metadata_copies_once_per_device():
    md = RecoverSSMMetadata.build([3, 2], [True, False], [0, 4], [1, 0], num_slots=4)
    assert md.to("cpu") is md and md.device == CPU
    on_meta = md.to(META)
    assert md.to(torch.device("meta")) is on_meta and on_meta.device == META
    assert on_meta.verify_indices.device == META and on_meta.prefill_rows == md.prefill_rows
    assert on_meta.to(META) is on_meta


def test_static_attention_layer_takes_write_positions_from_another_device():
    """A graphed cache run eagerly on a model spread over devices: the write positions come from
    the inputs' device and each attention layer moves them to its own."""
    from ssm_spec.hf.static_kv import StaticAttentionLayer

    layer = StaticAttentionLayer(8)
    layer.write_index = torch.tensor([3, 4])  # on the CPU
    keys, values = layer.update(torch.ones(1, 2, 2, 4, device=META), torch.ones(1, 2, 2, 4, device=META))
    assert keys.device == META and keys.shape == (1, 2, 8, 4)


# ----------------------------------------------------------------------------- the device each launch runs under


@pytest.fixture
def recorded_guards(monkeypatch):
    """``torch.cuda.device`` replaced by a recorder and the CPU and ``meta`` taken for devices
    whose kernels launch on the current device, as CUDA's Triton kernels do: a pool over the CPU
    and ``meta`` then guards its launches as a pool over two GPUs does, with no GPU. Yields
    ``(calls, guards)``: ``(op, its tensors' device, the device current at the call)`` per op
    call, and the device of every guard entered."""
    current, guards, calls = [], [], []

    class Recorder:
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            current.append(self.device)
            guards.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    real = _eager.call

    def recorded(name, *args):
        calls.append((name, args[0].device, current[-1] if current else None))
        return None if args[0].device.type == "meta" else real(name, *args)

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    monkeypatch.setattr(pools.placement, "CURRENT_DEVICE_TYPES", ("cpu", "meta"))
    monkeypatch.setattr(_eager, "call", recorded)
    return calls, guards


def _rollback_steps(layers, devices):
    """Forwards, crops and a reorder on a rollback pool of ``layers`` (every commit path of the
    Hugging Face cache: retiring pending tokens, bringing the scratch slots up to date, crops)."""
    gen = torch.Generator().manual_seed(3)
    rb = RollbackPool(layers, batch_size=2, max_pending=5, device=devices)
    with torch.no_grad():
        for L, crop in [(7, None), (4, 2), (1, 0), (3, 3), (5, 1)]:
            rb.begin_forward(L)
            x = torch.randn(2, L, 16, generator=gen)
            for m, d in zip(layers, devices):
                rb.run(m, x.to(d))
            if crop is not None:
                rb.crop(crop)
    rb.reorder(torch.tensor([1, 0]))
    return rb


@pytest.mark.parametrize("mode", [*POOL_MODES, "rollback"])
def test_every_launch_of_a_pool_over_two_devices_runs_under_its_device(recorded_guards, mode):
    """Triton launches on the current CUDA device, and accelerate's hooks never change it: on a
    pool over several devices every op call (each layer's verify, conv and prefill ops; commit's
    launches per group; a folded pool's flush, also the one a lazy plan runs inside a layer's
    step; the rollback pool's commits) runs with its own tensors' device current."""
    calls, guards = recorded_guards
    layers, devices = _placed("meta", "cpu")
    if mode == "rollback":
        assert _rollback_steps(layers, devices).pool.guarded
    else:
        pool = StatePool(layers, num_slots=4, max_tokens=16, device=devices, **POOL_MODES[mode])
        assert pool.guarded
        _drive(layers, devices, pool, CPU)
        if mode == "lazy":  # a prefill continuing a slot with pending tokens: the first layer's plan flushes it
            x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
            with torch.no_grad():
                md = _build([2], [False], [1], [1])
                for m, d in zip(layers, devices):
                    m(x[:2].to(d), md, pool)
                commit(pool, md, i32([2], CPU))
                before = len(calls)
                md = _build([3], [True], [3], [1])
                for m, d in zip(layers, devices):
                    m(x.to(d), md, pool)
            flushed = [(d, cur) for name, d, cur in calls[before:] if name == "gdn_closed_form_folded_verify"]
            assert {d for d, _ in flushed} == {CPU, META}  # inside the CPU layer's step, the meta groups too
    assert calls and {d for _, d, _ in calls} == {CPU, META}
    wrong = [(name, str(d), str(cur)) for name, d, cur in calls if cur != d]
    assert not wrong, f"launched with another device current: {wrong[:5]}"
    commits = {"gdn_commit", "short_conv_commit", "gdn_folded_verify", "gdn_closed_form_folded_verify"}
    assert commits & {name for name, _, _ in calls}  # the pool's own launches were among them


@pytest.mark.parametrize("mode", [*POOL_MODES, "rollback"])
def test_a_pool_on_one_device_launches_without_a_guard(recorded_guards, mode):
    """The single-device path stays as it was: no guard entered, for the layers or the pool."""
    calls, guards = recorded_guards
    layers = _two_shapes(0)
    if mode == "rollback":
        assert not _rollback_steps(layers, [CPU] * len(layers)).pool.guarded
    else:
        pool = StatePool(layers, num_slots=4, max_tokens=16, **POOL_MODES[mode])
        assert not pool.guarded and not pool.spread
        _drive(layers, [CPU] * len(layers), pool, CPU)
    assert calls and not guards


def test_needs_launch_guard(monkeypatch):
    """Several devices, one of them CUDA: guarded; one GPU other than the current one as the
    pool is made (a model placed on cuda:1 alone, run while cuda:0 is current): guarded; the
    current GPU or the CPU alone: launched as they are (no CUDA call for the CPU)."""
    cpu, cuda0, cuda1 = CPU, torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert pools.needs_launch_guard([cuda0, cuda1]) and pools.needs_launch_guard([cpu, cuda0])
    assert pools.needs_launch_guard([cuda1]) and not pools.needs_launch_guard([cuda0])
    assert not pools.needs_launch_guard([cpu, META])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked for the current CUDA device"))
    assert not pools.needs_launch_guard([cpu]) and not pools.needs_launch_guard([META])


# ----------------------------------------------------------------------------- one metadata object per step


def _build(lens, prefill, done, slots, device=None):
    return RecoverSSMMetadata.build(lens, prefill, done, slots, num_slots=4, device=device)


@pytest.mark.parametrize("mode", ["folded", "lazy"])
def test_folded_pool_refuses_a_second_metadata_object_in_one_step(mode):
    """A folded pool recognises a step by its metadata object (the first layer takes the plan
    and clears the counts it hands over): a later layer of the same step given another object,
    e.g. a per-device copy made by the caller, is refused before anything is written, instead
    of redoing the plan from cleared counts and losing the pending windows. A step whose
    forward ran without a commit is not a second object: the next step's metadata is taken."""
    import dataclasses

    layers = _two_shapes(0)
    gdn = [m for m in layers if isinstance(m, RecoverGatedDeltaNet)]
    pool = StatePool(layers, num_slots=4, max_tokens=16, **POOL_MODES[mode])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        md = _build([5], [True], [0], [1])
        x = torch.randn(5, 16, generator=gen)
        for m in layers:
            m(x, md, pool)
        md = _build([3], [False], [5], [1])
        x = torch.randn(3, 16, generator=gen)
        for m in layers:
            m(x, md, pool)
        commit(pool, md, i32([2], CPU))  # slot 1 now has a pending window
        md = _build([3], [False], [7], [1])
        layers[0](x, md, pool)
        before = [pool.gdn_state(m).clone() for m in gdn] + [pool.pending_count.clone(), pool.pending_start.clone()]
        with pytest.raises(ValueError, match="another metadata object"):
            layers[2](x, dataclasses.replace(md), pool)
        after = [pool.gdn_state(m) for m in gdn] + [pool.pending_count, pool.pending_start]
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing written
        for m in layers[1:]:  # the same object: the step goes on
            m(x, md, pool)
        commit(pool, md, i32([1], CPU))
        md = _build([2], [False], [8], [1])
        for m in layers:
            m(x[:2], md, pool)  # no commit after this step (dropped)
        md = _build([2], [False], [8], [1])
        for m in layers:
            m(x[:2], md, pool)  # a new step, taken
        commit(pool, md, i32([2], CPU))


@pytest.mark.parametrize("mode", ["folded", "lazy"])
def test_plan_and_metadata_copies_are_made_per_step(one_device_per_call, mode):
    """The copies a layer on another device reads are made once per step: every layer on
    ``meta`` gets the same copy of the step's plan and metadata; the next step (a new metadata
    object) gets new copies, never the last step's; ``per_device`` copies each call. The copies
    keep the originals' shapes and dtypes (their values are checked on the GPU, cpu+cuda)."""
    layers, devices = _placed("meta", "cpu")
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=devices, **POOL_MODES[mode])
    take = pool.lazy_plan if mode == "lazy" else pool.fold_plan
    on_meta = [m for m, d in zip(layers, devices) if d == META and isinstance(m, RecoverGatedDeltaNet)]
    seen = []
    for step in range(2):
        md = _build([3, 2], [False, False], [4 + step, 6 + step], [1, 3])
        plan = take(md, None, layers[0])  # the first layer: the plan itself, on pool.device
        copy = take(md, META, on_meta[0])
        assert take(md, META, on_meta[1]) is copy and take(md, CPU, layers[2]) is plan
        assert [(t.device, t.shape, t.dtype) for t in copy] == [(META, t.shape, t.dtype) for t in plan]
        assert md.to(META) is md.to(META) and md.to(META).verify_indices.shape == md.verify_indices.shape
        seen.append((md, copy))
        commit(pool, md, i32([1, 2], CPU))
    (md1, copy1), (md2, copy2) = seen
    assert copy2 is not copy1 and all(a is not b for a, b in zip(copy2, copy1))
    assert md2.to(META) is not md1.to(META)
    t = i32([1, 2], CPU)
    first, second = pool.per_device(t), pool.per_device(t)
    assert first[CPU][0] is t and first[META][0].device == META and first[META][0] is not second[META][0]


# ----------------------------------------------------------------------------- pool devices, spelled any way


def test_snapshot_slots_take_any_spelling_of_a_pool_device():
    layers, devices = _placed("meta", "cpu")
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=devices, snapshot=True)
    ref = pool.snapshot_slots(3)
    for spelling in ("cpu", "cpu:0", torch.device("cpu", 0), CPU):
        assert torch.equal(pool.snapshot_slots(3, spelling), ref)
    assert pool.snapshot_slots(3, "meta").device == META
    with pytest.raises(ValueError, match="this pool's devices are cpu, meta"):
        pool.snapshot_slots(3, "cuda:1")


def test_meta_cannot_hold_the_bookkeeping_of_a_pool_over_devices():
    """The first layer's device holds a step's bookkeeping and metadata: ``meta`` there is
    refused when the pool is made, with the reason (not later, at a host read of the counts).
    A pool on ``meta`` alone is allowed (shapes only)."""
    layers, devices = _placed("meta", "other")
    with pytest.raises(ValueError, match="first layer is on meta"):
        StatePool(layers, num_slots=4, max_tokens=16, device=devices)
    pool = StatePool(_two_shapes(0), num_slots=4, max_tokens=16, device="meta")
    assert pool.devices == (META,) and not pool.spread


# ----------------------------------------------------------------------------- where layers run


def _hooked(module, **hook):
    module._hf_hook = SimpleNamespace(**hook)
    return module


def test_execution_device_and_layer_devices():
    """A layer runs on its accelerate hook's execution device (a SequentialHook's first that
    names one), else where its weights are; offloaded weights (meta) say nothing. The pool
    gets one device per layer, always a list: the device each names, the hidden states' for a
    layer that names none; layers that all name one device get it, not the hidden states'."""
    plain = torch.nn.Linear(2, 2)
    assert execution_device(plain) == CPU
    assert execution_device(_hooked(torch.nn.Linear(2, 2), execution_device=1)) == torch.device("cuda", 1)
    seq = _hooked(torch.nn.Linear(2, 2), hooks=(SimpleNamespace(), SimpleNamespace(execution_device="cuda:2")))
    assert execution_device(seq) == torch.device("cuda", 2)
    offloaded = torch.nn.Linear(2, 2, device="meta")
    assert execution_device(offloaded) is None
    assert execution_device(_hooked(offloaded, execution_device="cpu", offload=True)) == CPU
    gpu = _hooked(torch.nn.Linear(2, 2), execution_device=torch.device("cuda", 0))
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert layer_devices([plain, torch.nn.Linear(2, 2)], "cuda:3") == [CPU, CPU]  # where they run, not the inputs
    # every GDN layer on cuda:1, the inputs (the main device) on cuda:0: the states go to cuda:1
    on1 = [_hooked(torch.nn.Linear(2, 2), execution_device=1) for _ in range(2)]
    assert layer_devices(on1, cuda0) == [cuda1, cuda1]
    assert layer_devices([plain, torch.nn.Linear(2, 2, device="meta"), gpu], META) == [CPU, META, cuda0]
    assert layer_devices([torch.nn.Linear(2, 2, device="meta")], "cpu:0") == [CPU]  # names none: the fallback's


def test_placement_problem_names_devices_and_offloading():
    assert placement_problem(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) is None
    two = torch.nn.Sequential(torch.nn.Linear(2, 2), _hooked(torch.nn.Linear(2, 2), execution_device=1))
    assert placement_problem(two) == "its layers run on cpu, cuda:1 (a device map)"
    off = torch.nn.Sequential(torch.nn.Linear(2, 2), _hooked(torch.nn.Linear(2, 2, device="meta"),
                                                             execution_device="cpu", offload=True))
    assert "offloads the weights of 1" in placement_problem(off)


# ----------------------------------------------------------------------------- Hugging Face, dispatched


def _device_map(layers, rest):
    """A device map of a tiny model: decoder layer ``i`` on ``layers[i]``, everything else on ``rest``.

    ``model.rotary_emb`` is named too: it holds only buffers (``inv_freq``), which a map that
    leaves it out keeps on the CPU, and Qwen3.5's multimodal rotary embedding multiplies them
    with position ids on ``rest`` without moving them (the unconverted model then fails on
    ``rest = cuda``: seen on the H200)."""
    return {"model.embed_tokens": rest, "model.rotary_emb": rest,
            **{f"model.layers.{i}": d for i, d in enumerate(layers)}, "model.norm": rest, "lm_head": rest}


def _dispatch(model, device_map, **kwargs):
    """``accelerate.dispatch_model`` as transformers calls it (the cache keyword never moved)."""
    import accelerate

    skip = getattr(model, "_skip_keys_device_placement", None)
    return accelerate.dispatch_model(model, device_map, skip_keys=skip, **kwargs)


def _ids(device="cpu"):
    return torch.tensor([TOK.encode(PROMPT)], device=device)


def _greedy(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kw)


def _with(model, cache):
    return {cache_kwarg(model): cache}


def _noisy_twin(kind, seed):
    draft = tiny_model(kind, seed=seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05 * p.std())
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


KINDS = ["qwen3_next", "qwen3_5"]


@pytest.mark.parametrize("kind", KINDS)
def test_accelerate_hooks_on_the_cpu_generate_plain_greedy(monkeypatch, kind):
    """``dispatch_model`` with every module on "cpu" and hooks forced: each converted layer keeps
    its layer's hook, the model's own hook still runs around the converted forward, and prompt
    lookup and a (dispatched, converted) assistant give plain greedy's tokens in fp32."""
    pytest.importorskip("accelerate")
    ids = _ids()
    plain = _greedy(tiny_model(kind, seed=0), ids, 96)
    model = tiny_model(kind, seed=0)
    model = _dispatch(model, _device_map(["cpu"] * 4, "cpu"), force_hooks=True)
    apply_recoverssm(model)
    adapters = [m for m in model.modules() if type(m).__name__ == "RecoverGDNAdapter"]
    assert len(adapters) == 3 and all("_hf_hook" in a.__dict__ for a in adapters)
    seen = []
    hook = model._hf_hook
    monkeypatch.setattr(hook, "pre_forward", functools.partial(lambda f, *a, **k: seen.append(1) or f(*a, **k),
                                                               hook.pre_forward))
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 96, prompt_lookup_num_tokens=5, **_with(model, cache))
    assert torch.equal(out, plain) and cache.stats.accepted > 0
    assert seen  # the model's accelerate hook wrapped every forward
    assert cache.rollback.pool.devices == (CPU,)
    draft = _noisy_twin(kind, 0)
    draft = apply_recoverssm(_dispatch(draft, _device_map(["cpu"] * 4, "cpu"), force_hooks=True))
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 96, assistant_model=draft, **_with(model, cache))
    assert torch.equal(out, plain) and 0 < cache.stats.accepted < cache.stats.drafted


@pytest.mark.parametrize("kind", KINDS)
def test_weights_offloaded_to_disk_generate_plain_greedy(tmp_path, kind):
    """``from_pretrained(device_map=...)`` with two decoder layers offloaded to the disk (their
    weights on ``meta`` between forwards, loaded by accelerate's hooks, ``conv1d.weight``
    included): the converted model's prompt lookup gives plain greedy's tokens and leaves the
    weights offloaded; ``cuda_graphs=True`` warns and runs eagerly with the plain cache (same
    tokens); ``tp_group`` is refused (nothing to slice)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    ids = _ids()
    ref = tiny_model(kind, seed=0)
    plain = _greedy(ref, ids, 64)
    ref.save_pretrained(str(tmp_path / "model"))
    dm = _device_map(["cpu", "disk", "cpu", "disk"], "cpu")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), device_map=dm,
                                                 offload_folder=str(tmp_path / "offload"))
    with pytest.raises(ValueError, match="offloaded"):
        apply_recoverssm(AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), device_map=dm,
                                                              offload_folder=str(tmp_path / "offload2")),
                         tp_group=object())
    apply_recoverssm(model)
    offloaded = model.model.layers[1].linear_attn
    assert offloaded.conv1d.weight.device == META and offloaded.A_log.device == META
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 64, prompt_lookup_num_tokens=5, **_with(model, cache))
    assert torch.equal(out, plain) and cache.stats.accepted > 0
    assert offloaded.conv1d.weight.device == META and offloaded.A_log.device == META  # offloaded again
    apply_recoverssm(model, cuda_graphs=True)
    with pytest.warns(RuntimeWarning, match="offloads the weights"):
        out = _greedy(model, ids, 64, prompt_lookup_num_tokens=5)
    assert torch.equal(out, plain) and kept_cache(model) is None
    graphed = RecoverSSMCache(model, max_cache_len=128).graphed  # a graphed cache passed in: no capture
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        assert graphed._capture(model, ids, None, torch.arange(ids.shape[1])) is None  # refused before CUDA
    assert "offloads the weights" in graphed.failed


def test_convert_then_dispatch_with_disk_offload(tmp_path):
    """Converting first and dispatching after also works: accelerate hooks the converted layers
    themselves, and the layer loads its conv weight through ``conv1d``'s hook."""
    pytest.importorskip("accelerate")
    ids = _ids()
    plain = _greedy(tiny_model("qwen3_next", seed=2), ids, 48)
    model = apply_recoverssm(tiny_model("qwen3_next", seed=2))
    model = _dispatch(model, _device_map(["cpu", "disk", "disk", "cpu"], "cpu"), offload_dir=str(tmp_path))
    assert model.model.layers[1].linear_attn.conv1d.weight.device == META
    out = _greedy(model, ids, 48, prompt_lookup_num_tokens=4)
    assert torch.equal(out, plain)


def test_drafts_on_a_model_whose_embeddings_are_offloaded_are_refused_clearly(tmp_path):
    """With ``model.embed_tokens`` offloaded to the disk ``model.device`` is ``meta``, where
    transformers' assisted loop moves every drafted token (accelerate then fails deep inside
    with "Cannot copy out of meta tensor"): prompt lookup and an assistant get a ``ValueError``
    naming the cause before any forward; plain greedy still gives the unconverted tokens."""
    pytest.importorskip("accelerate")
    ids = _ids()
    plain = _greedy(tiny_model("qwen3_5", seed=3), ids, 24)
    dm = {**_device_map(["cpu"] * 4, "cpu"), "model.embed_tokens": "disk"}
    model = apply_recoverssm(_dispatch(tiny_model("qwen3_5", seed=3), dm, offload_dir=str(tmp_path)))
    assert model.device == META
    assert torch.equal(_greedy(model, ids, 24), plain)
    draft = apply_recoverssm(tiny_model("qwen3_5", seed=4))
    for kw in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": draft}):
        with pytest.raises(ValueError, match="model.device.*'meta'"):
            _greedy(model, ids, 24, **kw)


def test_carried_hook_is_a_copy_that_keeps_the_original_devices():
    """``carry_hook`` attaches a copy (of each member of a ``SequentialHook``): attaching runs
    ``init_hook``, which records the module's weight devices, and the converted layer's weights
    are offloaded (meta) already. The copy keeps the old layer's record, so removing the hooks
    brings the weights back to the CPU with their values; the old hook is left as it was."""
    pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module, \
        remove_hook_from_module

    from ssm_spec.hf.placement import carry_hook

    for sequential in (False, True):
        old = torch.nn.Linear(3, 2)
        want = {name: p.detach().clone() for name, p in old.named_parameters()}
        add_hook_to_module(old, AlignDevicesHook(execution_device="cpu", offload=True))
        if sequential:
            add_hook_to_module(old, ModelHook(), append=True)
        assert old.weight.device == META
        new = torch.nn.Linear(3, 2, device="meta")  # the converted layer: the same names, offloaded
        carry_hook(old, new)
        assert new._hf_hook is not old._hf_hook and isinstance(new._hf_hook, SequentialHook) == sequential
        members = lambda m: getattr(m._hf_hook, "hooks", (m._hf_hook,))  # noqa: E731
        assert all(a is not b for a, b in zip(members(old), members(new)))
        assert members(old)[0].original_devices == {"weight": CPU, "bias": CPU}  # untouched
        assert members(new)[0].original_devices == {"weight": CPU, "bias": CPU}
        assert new(torch.ones(1, 3)).shape == (1, 2)  # loads and offloads as old's hook did
        assert new.weight.device == META
        remove_hook_from_module(new)
        assert all(torch.equal(p, want[name]) for name, p in new.named_parameters())


def test_removing_the_hooks_of_a_converted_offloaded_model_restores_its_weights(tmp_path):
    """``remove_hook_from_module(model, recurse=True)`` after disk offloading and conversion
    brings every weight back, ``A_log`` and ``dt_bias`` of the converted layers included, and
    the model (without hooks) still generates plain greedy's tokens."""
    pytest.importorskip("accelerate")
    from accelerate.hooks import remove_hook_from_module

    ids = _ids()
    plain = _greedy(tiny_model("qwen3_next", seed=0), ids, 32)
    model = _dispatch(tiny_model("qwen3_next", seed=0), _device_map(["cpu", "disk", "cpu", "disk"], "cpu"),
                      offload_dir=str(tmp_path))
    apply_recoverssm(model)
    layer = model.model.layers[1].linear_attn
    assert layer.A_log.device == META
    remove_hook_from_module(model, recurse=True)
    assert not [name for name, p in model.named_parameters() if p.device != CPU]
    assert torch.equal(_greedy(model, ids, 32, prompt_lookup_num_tokens=5), plain)


def test_offloaded_conv_weight_is_loaded_once_per_forward(tmp_path, monkeypatch):
    """A forward with a prefill part and a verify part runs the layer's step twice; the offloaded
    ``conv1d.weight`` it reads is loaded once (around the whole forward), not once per part."""
    pytest.importorskip("accelerate")
    model = _dispatch(tiny_model("qwen3_5", seed=0), _device_map(["cpu", "disk", "cpu", "disk"], "cpu"),
                      offload_dir=str(tmp_path))
    apply_recoverssm(model)
    conv = model.model.layers[1].linear_attn.conv1d
    assert conv.weight.device == META
    loads = []
    hook = conv._hf_hook
    monkeypatch.setattr(hook, "pre_forward", functools.partial(lambda f, *a, **k: loads.append(1) or f(*a, **k),
                                                               hook.pre_forward))
    cache = RecoverSSMCache(model, max_pending=4)
    with torch.no_grad():
        model(input_ids=_ids(), use_cache=True, **_with(model, cache))
    plan = cache.rollback.plan
    assert plan.prefill is not None and plan.verify is not None
    assert len(loads) == 1 and conv.weight.device == META


# ----------------------------------------------------------------------------- GPU: cuda:0 and the CPU


def _split(kind, layers, rest="cpu"):
    """``kind`` dispatched by accelerate with decoder layers on ``layers`` and the rest on
    ``rest``, every module running where the map puts it (``main_device="cpu"``: the "cpu"
    entries are not offloaded but run on the CPU)."""
    return _dispatch(tiny_model(kind, seed=0), _device_map(layers, rest), main_device="cpu")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_split_over_cuda_and_cpu_generates_plain_greedy(kind):
    """Decoder layers 0 and 2 on cuda:0, 1 and 3 (and the head) on the CPU: prompt lookup on the
    converted model gives the tokens of plain greedy on the same split, unconverted, in fp32;
    the pool has one GDN group per device, each layer's states on its device."""
    pytest.importorskip("accelerate")
    layers = [0, "cpu", 0, "cpu"]
    ids = _ids()
    plain = _greedy(_split(kind, layers), ids, 128)
    model = apply_recoverssm(_split(kind, layers))
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 128, prompt_lookup_num_tokens=5, **_with(model, cache))
    assert torch.equal(out.cpu(), plain.cpu()) and cache.stats.accepted > 0
    pool = cache.rollback.pool
    cuda0 = torch.device("cuda", 0)
    assert sorted(map(str, pool.devices)) == ["cpu", "cuda:0"]
    assert sorted(str(d) for d, _ in pool.gdn_groups) == ["cpu", "cuda:0"]
    assert pool.gdn_state(model.model.layers[0].linear_attn).device == cuda0
    assert pool.gdn_state(model.model.layers[1].linear_attn).device == CPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_split_model_with_cuda_graphs_warns_and_runs_eagerly():
    """``cuda_graphs=True`` on a model split over cuda:0 and the CPU: one warning naming the
    devices, the plain cache, plain greedy's tokens."""
    pytest.importorskip("accelerate")
    layers = [0, "cpu", 0, "cpu"]
    ids = _ids()
    plain = _greedy(_split("qwen3_next", layers), ids, 64)
    model = apply_recoverssm(_split("qwen3_next", layers), cuda_graphs=True)
    with pytest.warns(RuntimeWarning, match="cpu, cuda:0"):
        out = _greedy(model, ids, 64, prompt_lookup_num_tokens=5)
    assert torch.equal(out.cpu(), plain.cpu()) and kept_cache(model) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cpu_offload_runs_on_the_gpu(tmp_path):
    """``from_pretrained`` with "cpu" entries and a GPU offloads those layers' weights to host
    memory and runs them on cuda:0: every state lives on cuda:0 (one group per shape) and
    prompt lookup gives the tokens of the same placement, unconverted. A graphed cache passed
    in is not captured (the offloaded weights are loaded per forward): one warning, eager
    forwards, the same tokens."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    tiny_model("qwen3_5", seed=0).save_pretrained(str(tmp_path))
    dm = _device_map([0, "cpu", 0, "cpu"], 0)
    ids = _ids("cuda:0")  # transformers' assisted loop compares tokens on the inputs' device and the model's
    plain = _greedy(AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map=dm), ids, 96)
    model = apply_recoverssm(AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map=dm))
    assert "offloads the weights" in placement_problem(model)
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 96, prompt_lookup_num_tokens=5, **_with(model, cache))
    assert torch.equal(out.cpu(), plain.cpu()) and cache.stats.accepted > 0
    assert cache.rollback.pool.devices == (torch.device("cuda", 0),)
    cache = RecoverSSMCache(model, max_pending=6, max_cache_len=256)  # inputs reach it on cuda:0 (main device)
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        out = _greedy(model, ids, 96, prompt_lookup_num_tokens=5, **_with(model, cache))
    assert torch.equal(out.cpu(), plain.cpu()) and cache.graphed.replays == 0 and cache.graphed.failed


@pytest.mark.parametrize("layers,rest,groups", [
    ([0, 0, 1, 1], 1, ["cuda:0", "cuda:1"]),
    ([1, 0, 1, 0], 0, ["cuda:0", "cuda:1"]),  # the first GDN layer (the pool's bookkeeping) on cuda:1
    ([1, 1, 1, 1], 0, ["cuda:1"]),  # every layer on cuda:1, the inputs on cuda:0: the pool on cuda:1 alone
])
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_split_over_two_gpus_generates_plain_greedy(one_device_per_call, layers, rest, groups):
    """Two GPUs, cuda:0 current throughout: every launch runs with its tensors' device current
    (``one_device_per_call``; Triton launches on the current device), and prompt lookup gives
    plain greedy's tokens."""
    pytest.importorskip("accelerate")
    assert torch.cuda.current_device() == 0
    ids = _ids(torch.device("cuda", rest))
    plain = _greedy(_split("qwen3_next", layers, rest=rest), ids, 128)
    model = apply_recoverssm(_split("qwen3_next", layers, rest=rest))
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 128, prompt_lookup_num_tokens=5, **_with(model, cache))
    assert torch.equal(out.cpu(), plain.cpu()) and cache.stats.accepted > 0
    assert sorted(str(d) for d, _ in cache.rollback.pool.gdn_groups) == groups
    assert cache.rollback.pool.guarded and one_device_per_call
