"""Device maps (docs/design.md section 5.9): a ``StatePool`` groups layers by (device, shape) and
runs every launch once per group on the group's device; a Hugging Face model placed by a
``device_map`` (accelerate hooks, offloaded weights) generates plain greedy's tokens after
``apply_recoverssm``.

On the CPU a pool spread over the CPU and the ``meta`` device stands in for two devices: every
op call is checked to get tensors of one device only (a plan or slot tensor left on the wrong
device fails the test), the meta half computes nothing, and the CPU half must equal, bit for
bit, a pool on the CPU alone. The GPU tests (marked ``gpu``) run the same comparison with
``cuda`` as the second device, on both halves, and split a tiny model over ``cuda:0`` and the
CPU.
"""

import functools
from types import SimpleNamespace

import pytest
import torch

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit
from ssm_spec.hf import RecoverSSMCache, apply_recoverssm, tiny_model
from ssm_spec.hf.placement import execution_device, layer_devices, placement_problem
from ssm_spec.hf.rollback import RollbackPool
from ssm_spec.hf.tiny import ByteTokenizer
from ssm_spec.ops import _eager
from ssm_spec.pools import ConvStateSpec, GDNStateSpec, group_layers, placement_device
from tests.helpers import i32, randomize_

HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]
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
    device than its group's fails here, whatever the op's own checks); calls on ``meta``
    compute nothing. Yields the list of ``(op, device)`` calls."""
    real = _eager.call
    calls = []

    def checked(name, *args):
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        assert len(devices) == 1, f"{name} got tensors on {devices}"
        calls.append((name, args[0].device))
        return None if args[0].device.type == "meta" else real(name, *args)

    monkeypatch.setattr(_eager, "call", checked)
    return calls


OTHER = [pytest.param("meta", id="cpu+meta"), pytest.param("cuda", id="cpu+cuda", marks=GPU)]
POOL_MODES = {"exact": {}, "snapshot": dict(snapshot=True), "folded": dict(folded=True), "fast": dict(mode="fast"),
              "lazy": dict(mode="fast", folded=True, max_pending=3)}
W = 4


def _placed(other, first):
    """Two copies of the stack, one on the CPU and one on ``other``, interleaved; ``first``:
    which device holds the first layer (and so the pool's bookkeeping and metadata)."""
    cpu_layers, other_layers = _two_shapes(0), [m.to(other) for m in _two_shapes(1)]
    pairs = zip(cpu_layers, other_layers) if first == "cpu" else zip(other_layers, cpu_layers)
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


def _compare_half(layers, devices, half, mixed, mixed_outs, pool_kwargs):
    """The layers on ``half``, run alone on a pool on ``half``, give the mixed pool's bits."""
    mine = [(m, d) for m, d in zip(layers, devices) if d == half]
    alone = StatePool([m for m, _ in mine], num_slots=4, max_tokens=16, device=half, **pool_kwargs)
    outs = _drive([m for m, _ in mine], [half] * len(mine), alone, half)
    for m, _ in mine:
        for a, b in zip(mixed_outs[id(m)], outs[id(m)]):
            assert torch.equal(a, b)
        assert torch.equal(mixed.conv_state(m), alone.conv_state(m))
        if isinstance(m, RecoverGatedDeltaNet):
            assert torch.equal(mixed.gdn_state(m), alone.gdn_state(m))


@pytest.mark.parametrize("mode", list(POOL_MODES))
@pytest.mark.parametrize("other,first", [
    pytest.param("meta", "cpu", id="cpu+meta"),  # meta cannot come first: commit's validation reads the counts
    pytest.param("cuda", "cpu", id="cpu+cuda", marks=GPU),
    pytest.param("cuda", "other", id="cuda+cpu", marks=GPU),
])
def test_pool_over_two_devices_equals_a_pool_per_device(one_device_per_call, other, first, mode):
    """A stack spread over two devices, every pool mode (exact, snapshot, folded, fast, fast
    folded with the lazy commit): groups by (device, shape), each state on its layer's device,
    every commit launch once per group on its device, and each half's outputs and states equal,
    bit for bit, the same layers run on a pool of their own device. Metadata and accepted counts
    come from the first layer's device; the others read copies."""
    layers, devices = _placed(other, first)
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=devices, **POOL_MODES[mode])
    main = devices[0]
    assert pool.device == main and set(pool.devices) == {CPU, placement_device(other)}
    assert len(pool.gdn_groups) == 4 and len(pool.conv_groups) == 6  # two GDN shapes, three conv shapes, per device
    for m, d in zip(layers, devices):
        assert pool.conv_state(m).device == d and pool.device_of(m) == d
    outs = _drive(layers, devices, pool, main, one_device_per_call)
    assert {d for _, d in one_device_per_call} == {CPU, placement_device(other)}
    for half in {CPU, placement_device(other)} - {META}:
        _compare_half(layers, devices, half, pool, outs, POOL_MODES[mode])


@pytest.mark.parametrize("other", OTHER)
def test_rollback_pool_over_two_devices(one_device_per_call, other):
    """The Hugging Face path's pool (checkpoint and scratch slots, pending records, crops,
    row reordering) on two devices: each half equals a rollback pool of its own device; hidden
    states on another device than the layer's states are refused."""
    layers, devices = _placed(other, "cpu")
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
    assert set(rb.pool.devices) == {CPU, placement_device(other)}
    for half in {CPU, placement_device(other)} - {META}:
        mine = [m for m, d in zip(layers, devices) if d == half]
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


# ----------------------------------------------------------------------------- where layers run


def _hooked(module, **hook):
    module._hf_hook = SimpleNamespace(**hook)
    return module


def test_execution_device_and_layer_devices():
    """A layer runs on its accelerate hook's execution device (a SequentialHook's first that
    names one), else where its weights are; offloaded weights (meta) say nothing. The pool
    takes one device unless the layers name several."""
    plain = torch.nn.Linear(2, 2)
    assert execution_device(plain) == CPU
    assert execution_device(_hooked(torch.nn.Linear(2, 2), execution_device=1)) == torch.device("cuda", 1)
    seq = _hooked(torch.nn.Linear(2, 2), hooks=(SimpleNamespace(), SimpleNamespace(execution_device="cuda:2")))
    assert execution_device(seq) == torch.device("cuda", 2)
    offloaded = torch.nn.Linear(2, 2, device="meta")
    assert execution_device(offloaded) is None
    assert execution_device(_hooked(offloaded, execution_device="cpu", offload=True)) == CPU
    gpu = _hooked(torch.nn.Linear(2, 2), execution_device=torch.device("cuda", 0))
    assert layer_devices([plain, torch.nn.Linear(2, 2)], "cuda:3") == "cuda:3"  # one device: the hidden states'
    assert layer_devices([plain, torch.nn.Linear(2, 2, device="meta"), gpu], META) == [CPU, META,
                                                                                       torch.device("cuda", 0)]


def test_placement_problem_names_devices_and_offloading():
    assert placement_problem(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) is None
    two = torch.nn.Sequential(torch.nn.Linear(2, 2), _hooked(torch.nn.Linear(2, 2), execution_device=1))
    assert placement_problem(two) == "its layers run on cpu, cuda:1 (a device map)"
    off = torch.nn.Sequential(torch.nn.Linear(2, 2), _hooked(torch.nn.Linear(2, 2, device="meta"),
                                                             execution_device="cpu", offload=True))
    assert "offloads the weights of 1" in placement_problem(off)


# ----------------------------------------------------------------------------- Hugging Face, dispatched


def _device_map(layers, rest):
    """A device map of a tiny model: decoder layer ``i`` on ``layers[i]``, everything else on ``rest``."""
    return {"model.embed_tokens": rest, **{f"model.layers.{i}": d for i, d in enumerate(layers)},
            "model.norm": rest, "lm_head": rest}


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
    return {model._recoverssm["cache_kwarg"]: cache}


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
    assert torch.equal(out, plain) and model._recoverssm["graph_cache"].cache is None
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
    assert torch.equal(out.cpu(), plain.cpu()) and model._recoverssm["graph_cache"].cache is None


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
    ids = _ids()
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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_split_over_two_gpus_generates_plain_greedy():
    pytest.importorskip("accelerate")
    layers = [0, 0, 1, 1]
    ids = _ids()
    plain = _greedy(_split("qwen3_next", layers, rest=1), ids, 128)
    model = apply_recoverssm(_split("qwen3_next", layers, rest=1))
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 128, prompt_lookup_num_tokens=5, **_with(model, cache))
    assert torch.equal(out.cpu(), plain.cpu())
    assert sorted(str(d) for d, _ in cache.rollback.pool.gdn_groups) == ["cuda:0", "cuda:1"]
