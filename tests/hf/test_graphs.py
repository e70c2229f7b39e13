"""``apply_recoverssm(model, cuda_graphs=True, decode_loop=False)``: static attention buffers and graphed forwards.

These are the forwards transformers' own loop runs (``decode_loop=False``, and the fallback of the
decode loop); the decode loop's captured rounds are tested in ``test_decode_loop.py``.

On the CPU the graphed forward runs its body eagerly (the same static buffers, positions and
mask); on CUDA verify forwards are captured and replayed. Either way greedy fp32 generate must
give plain generate's tokens, and on CUDA a replayed forward must give the eager body's logits
bit for bit.
"""

import pytest
import torch

from ssm_spec.hf import RecoverSSMCache, apply_recoverssm, cache_kwarg, kept_cache, tiny_model
from ssm_spec.hf.static_kv import StaticAttentionLayer
from ssm_spec.hf.tiny import ByteTokenizer

KINDS = ["qwen3_next", "qwen3_5"]
TOK = ByteTokenizer()
PROMPT = "the cat sat on the mat. the cat sat on the"


def _ids(device, text=PROMPT):
    return torch.tensor([TOK.encode(text)], device=device)


def _greedy(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kw)


def _kept(model) -> RecoverSSMCache:
    return kept_cache(model)


def _new_tokens(device):
    return 128 if device.type == "cuda" else 96


@pytest.mark.parametrize("kind", KINDS)
def test_graphed_generate_equals_plain_greedy(device, kind):
    """Plain, prompt lookup (5 and 2 drafts) and a converted assistant through the graphed
    forward equal plain greedy generate of the unconverted model, token for token (fp32)."""
    ref = tiny_model(kind, seed=3).to(device)
    model = apply_recoverssm(tiny_model(kind, seed=3).to(device), cuda_graphs=True, decode_loop=False)
    ids = _ids(device)
    n = _new_tokens(device)
    plain = _greedy(ref, ids, n)
    assert torch.equal(_greedy(model, ids, n), plain)
    for k in (5, 2):  # 5 grows the kept cache's record buffers: its graphs are dropped, then captured anew
        out = _greedy(model, ids, n, prompt_lookup_num_tokens=k)
        assert torch.equal(out, plain), k
        assert _kept(model).stats.accepted > 0
        assert _kept(model).graphed.failed is None, _kept(model).graphed.failed
    draft = apply_recoverssm(tiny_model(kind, seed=3).to(device))
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0
    assert torch.equal(_greedy(model, ids, n, assistant_model=draft), plain)
    graphed = _kept(model).graphed
    if device.type == "cuda":
        assert graphed.failed is None, graphed.failed
        assert graphed.replays > 0 and graphed.graphs


def test_model_as_its_own_assistant_keeps_its_graphed_cache(device):
    """The assistant's own generate calls (the same model) run on plain caches: the target's
    kept graphed cache is never reset under it."""
    ref = tiny_model("qwen3_5", seed=4).to(device)
    model = apply_recoverssm(tiny_model("qwen3_5", seed=4).to(device), cuda_graphs=True, decode_loop=False)
    model.generation_config.num_assistant_tokens = 4
    model.generation_config.assistant_confidence_threshold = 0.0
    ids = _ids(device)
    plain = _greedy(ref, ids, 48)
    assert torch.equal(_greedy(model, ids, 48, assistant_model=model), plain)
    stats = _kept(model).stats
    assert stats.accepted == stats.drafted > 0


def test_graph_cache_is_kept_and_reset_between_calls(device):
    """One cache (and its graphs) serves successive calls that fit it; a call that needs more
    tokens replaces it; a deepcopy of the model starts without it."""
    import copy

    model = apply_recoverssm(tiny_model("qwen3_next", seed=1).to(device), cuda_graphs=True, decode_loop=False)
    ids = _ids(device)
    first = _greedy(model, ids, 24, prompt_lookup_num_tokens=3)
    cache = _kept(model)
    graphed = cache.graphed
    # every forward but the prompt's is capturable with the arguments this transformers version
    # passes (counted on the CPU too, where the body then runs eagerly)
    assert graphed.capturable_forwards == graphed.replays + graphed.eager_forwards - 1 > 0
    captured = len(cache.graphed.graphs)
    again = _greedy(model, ids, 24, prompt_lookup_num_tokens=3)
    assert torch.equal(first, again)
    assert _kept(model) is cache and len(cache.graphed.graphs) == captured
    assert cache.get_seq_length() == ids.shape[1] + 24 - 1  # the last token is never fed back
    longer = _greedy(model, ids, cache.kv_capacity, prompt_lookup_num_tokens=3)
    assert _kept(model) is not cache and _kept(model).kv_capacity > cache.kv_capacity
    assert torch.equal(longer[:, : first.shape[1]], first)
    twin = copy.deepcopy(model)
    assert kept_cache(twin) is None
    assert torch.equal(_greedy(twin, ids, 24, prompt_lookup_num_tokens=3), first)


def test_padded_batch_uses_the_plain_cache(device):
    """cuda_graphs covers unpadded rows; a padded batch runs on the growing cache, unchanged."""
    model = apply_recoverssm(tiny_model("qwen3_next", seed=2).to(device), cuda_graphs=True, decode_loop=False)
    plain_model = apply_recoverssm(tiny_model("qwen3_next", seed=2).to(device), decode_loop=False)
    a, b = TOK.encode("the cat sat"), TOK.encode("a dog ran off to the")
    pad = TOK.pad_token_id
    ids = torch.tensor([[pad] * (len(b) - len(a)) + a, b], device=device)
    mask = (ids != pad).long()
    kw = dict(attention_mask=mask, pad_token_id=pad)
    out = _greedy(model, ids, 16, **kw)
    assert _kept(model) is None
    assert torch.equal(out, _greedy(plain_model, ids, 16, **kw))


def test_static_layer_bookkeeping_and_refusals(device):
    """Capacity and padding are refused before anything changes; crops only lower lengths."""
    model = apply_recoverssm(tiny_model("qwen3_5", seed=0).to(device))
    key = cache_kwarg(model)
    ids = _ids(device)
    P = ids.shape[1]
    cache = RecoverSSMCache(model, max_pending=4, max_cache_len=P + 3)
    assert any(isinstance(layer, StaticAttentionLayer) for layer in cache.layers)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{key: cache})
        assert cache.get_seq_length() == P
        with pytest.raises(ValueError, match="exceed max_cache_len"):
            model(input_ids=ids[:, :4], use_cache=True, **{key: cache})
        assert cache.get_seq_length() == P and cache.rollback.seen == P
        model(input_ids=ids[:, :3], use_cache=True, **{key: cache})
        cache.crop(-2)
        assert cache.get_seq_length() == P + 1 and cache.rollback.seen == P + 1
        fresh = RecoverSSMCache(model, max_cache_len=64)
        with pytest.raises(ValueError, match="padding"):
            model(input_ids=ids, attention_mask=torch.zeros_like(ids), use_cache=True, **{key: fresh})
        assert fresh.get_seq_length() == 0 and fresh.rollback is None
    with pytest.raises(ValueError, match="max_cache_len"):
        RecoverSSMCache(model, max_cache_len=0)
    layer = StaticAttentionLayer(8)
    layer.length = 5
    layer.crop(-2)
    assert layer.length == 3
    layer.crop(10)
    assert layer.length == 3
    with pytest.raises(ValueError):
        layer.crop(-4)


def test_unsupported_attention_implementation_is_refused():
    model = tiny_model("qwen3_next", seed=0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation"):
        apply_recoverssm(model, cuda_graphs=True, decode_loop=False)


def test_output_hidden_states_runs_eagerly(device):
    """A forward asking for more than logits runs the graphed body eagerly (never captured)."""
    model = apply_recoverssm(tiny_model("qwen3_next", seed=5).to(device))
    key = cache_kwarg(model)
    ids = _ids(device)
    cache = RecoverSSMCache(model, max_pending=3, max_cache_len=128)
    ref = RecoverSSMCache(model, max_pending=3)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{key: cache})
        model(input_ids=ids, use_cache=True, **{key: ref})
        before = cache.graphed.eager_forwards
        out = model(input_ids=ids[:, -2:], use_cache=True, output_hidden_states=True, **{key: cache})
        want = model(input_ids=ids[:, -2:], use_cache=True, **{key: ref})
    assert cache.graphed.eager_forwards == before + 1 and not cache.graphed.graphs
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_body_bitwise(dtype):
    """The same generate calls with capture on and off give the same logits bit for bit (a
    replay runs the eager body's kernels on the same inputs)."""
    device = torch.device("cuda")
    ids = _ids(device)
    logits = []
    for capture in (True, False):
        model = apply_recoverssm(tiny_model("qwen3_next", seed=6, dtype=dtype).to(device), cuda_graphs=True, decode_loop=False)
        _greedy(model, ids, 8, prompt_lookup_num_tokens=4)  # makes the kept cache
        graphed = _kept(model).graphed
        graphed.capture = capture
        before = graphed.replays
        out = _greedy(model, ids, 64, prompt_lookup_num_tokens=4, output_logits=True, return_dict_in_generate=True)
        logits.append(torch.cat(out.logits))
        assert (graphed.replays > before) == capture and graphed.failed is None
    assert torch.equal(logits[0], logits[1])


def test_body_rerun_keeps_the_plan(device):
    """Capture runs the forward's body twice (a warm-up, then the capture) inside one open
    forward with one host-side plan: the second run must neither begin another plan nor change
    what it computes (state counts, attention lengths and logits as with one run)."""
    model = apply_recoverssm(tiny_model("qwen3_next", seed=7).to(device))
    key = cache_kwarg(model)
    ids = _ids(device)
    results = []
    for twice in (False, True):
        cache = RecoverSSMCache(model, max_pending=4, max_cache_len=128)
        graphed = cache.graphed
        graphed.capture = False
        if twice:
            body = graphed._body

            def run_twice(*args, **kwargs):
                first = body(*args, **kwargs)
                second = body(*args, **kwargs)
                assert torch.equal(first.logits, second.logits)
                return second

            graphed._body = run_twice
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{key: cache})
            out = model(input_ids=ids[:, -3:], use_cache=True, **{key: cache})
        rb = cache.rollback
        results.append(((rb.seen, rb.pending, cache._forwards, [layer.length for layer in graphed.static_layers]),
                        out.logits))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


def _graphed_and_ref(kind="qwen3_next", seed=8, device="cpu", **kw):
    ref = tiny_model(kind, seed=seed, **kw).to(device)
    return apply_recoverssm(tiny_model(kind, seed=seed, **kw).to(device), cuda_graphs=True, decode_loop=False), ref


def test_generate_without_cache_and_with_expanded_batches(device):
    """use_cache=False re-feeds the whole sequence (no cache is made: the converted model's
    generate used to pass one anyway, and the state ran on); beam search and
    num_return_sequences expand the batch inside generate after a batch-1 call kept a cache."""
    model, ref = _graphed_and_ref(device=device)
    ids = _ids(device, "the cat sat")
    want = _greedy(ref, ids, 6, use_cache=False)
    assert torch.equal(_greedy(model, ids, 6, use_cache=False), want)
    plain_model = apply_recoverssm(tiny_model("qwen3_next", seed=8).to(device))  # no cache made either
    assert torch.equal(_greedy(plain_model, ids, 6, use_cache=False), want)
    assert torch.equal(_greedy(model, ids, 12), _greedy(ref, ids, 12))
    beams = dict(num_beams=2, early_stopping=True)
    assert torch.equal(_greedy(model, ids, 12, **beams), _greedy(ref, ids, 12, **beams))
    torch.manual_seed(0)
    want = ref.generate(ids, max_new_tokens=8, do_sample=True, num_return_sequences=2)
    torch.manual_seed(0)
    got = model.generate(ids, max_new_tokens=8, do_sample=True, num_return_sequences=2)
    assert torch.equal(got, want)
    assert torch.equal(_greedy(model, ids, 12, prompt_lookup_num_tokens=3), _greedy(ref, ids, 12))


def test_kept_cache_follows_inference_mode_dtype_and_parameters(device):
    """A call under inference_mode, a dtype change and new parameter tensors each get a new
    kept cache (its buffers and graphs belong to what it was made for)."""
    model, ref = _graphed_and_ref(device=device)
    ids = _ids(device)
    with torch.inference_mode():
        _greedy(model, ids, 8)
    assert torch.equal(_greedy(model, ids, 8), _greedy(ref, ids, 8))
    first = _kept(model)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    _greedy(model, ids, 8)
    assert _kept(model) is not first
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    assert torch.equal(_greedy(model, ids, 8), _greedy(ref, ids, 8))


def test_prompt_forward_keeps_only_the_logits_asked_for(device):
    """The prompt's eager forward passes logits_to_keep to the model (no [P, vocab] logits)."""
    model, _ = _graphed_and_ref(device=device)
    rows = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: rows.append(out.shape[1]))
    ids = _ids(device)
    _greedy(model, ids, 4)
    assert rows[0] == 1 and max(rows) == 1


def test_forward_arguments_are_honoured(device):
    """Direct forwards with a graphed cache: hidden states, loss and tuples come back; explicit
    position_ids and a tensor logits_to_keep act as on the plain cache; use_cache=False leaves
    the cache alone; the base model refuses a graphed cache before anything changes."""
    model, _ = _graphed_and_ref(device=device)
    key = cache_kwarg(model)
    ids = _ids(device)
    P = ids.shape[1]
    cache = RecoverSSMCache(model, max_pending=4, max_cache_len=128)
    ref = RecoverSSMCache(model, max_pending=4)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{key: cache})
        model(input_ids=ids, use_cache=True, **{key: ref})
        tail = ids[:, -3:]
        pos = torch.arange(P + 5, P + 8, device=device)[None]
        keep = torch.tensor([0, 2], device=device)
        got = model(input_ids=tail, position_ids=pos, logits_to_keep=keep, use_cache=True, **{key: cache})
        want = model(input_ids=tail, position_ids=pos, logits_to_keep=keep, use_cache=True, **{key: ref})
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        assert got.logits.shape[1] == 2
        cache.crop(-3)
        ref.crop(-3)
        out = model(input_ids=tail, labels=tail, output_hidden_states=True, use_cache=True, **{key: cache})
        assert out.loss is not None and out.hidden_states is not None
        cache.crop(-3)
        tup = model(input_ids=tail, use_cache=True, return_dict=False, **{key: cache})
        assert isinstance(tup, tuple) and torch.is_tensor(tup[0])
        cache.crop(-3)
        seen = cache.get_seq_length()
        model(input_ids=tail, use_cache=False, **{key: cache})
        assert cache.get_seq_length() == seen == cache.rollback.seen
        with pytest.raises(ValueError, match="base model"):
            model.model(input_ids=tail, use_cache=True, **{key: cache})
        assert cache.get_seq_length() == seen == cache.rollback.seen


def test_padded_prompt_without_mask_uses_the_plain_cache(device):
    """generate infers a padding mask from pad_token_id: such prompts are not graphed."""
    model, ref = _graphed_and_ref(device=device)
    pad = TOK.pad_token_id
    a, b = TOK.encode("the cat sat"), TOK.encode("a dog ran off to the")
    ids = torch.tensor([[pad] * (len(b) - len(a)) + a, b], device=device)
    out = _greedy(model, ids, 8, pad_token_id=pad)
    assert _kept(model) is None
    assert torch.equal(out, _greedy(ref, ids, 8, pad_token_id=pad))


def test_explicit_generation_config(device):
    """A GenerationConfig passed in leaves use_cache and pad_token_id unset (None): they come from
    the model's defaults, as transformers fills them (a None use_cache used to mean no cache,
    and the converted layers then met transformers' DynamicCache)."""
    from transformers import GenerationConfig

    model, ref = _graphed_and_ref(device=device)
    plain_model = apply_recoverssm(tiny_model("qwen3_next", seed=8).to(device))
    ids = _ids(device)
    want = ref.generate(ids, generation_config=GenerationConfig(max_new_tokens=24, do_sample=False))
    for m in (model, plain_model):
        for k in (None, 4):
            gc = GenerationConfig(max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=k)
            assert torch.equal(m.generate(ids, generation_config=gc), want), (m is model, k)
    pad = TOK.pad_token_id
    padded = torch.cat([torch.full((1, 2), pad, device=device), ids], 1)
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, use_cache=True)
    apply_recoverssm(model, cuda_graphs=False)
    apply_recoverssm(model, cuda_graphs=True, decode_loop=False)  # drops the kept cache
    out = model.generate(padded, generation_config=gc)  # the pad id is the model's: a plain cache
    assert _kept(model) is None
    assert torch.equal(out, plain_model.generate(padded, generation_config=gc))


def test_passed_graphed_cache_too_small_is_refused_up_front(device):
    model, _ = _graphed_and_ref(device=device)
    key = cache_kwarg(model)
    ids = _ids(device)
    cache = RecoverSSMCache(model, max_pending=4, max_cache_len=ids.shape[1] + 20)
    with pytest.raises(ValueError, match="max_cache_len"):
        _greedy(model, ids, 50, prompt_lookup_num_tokens=3, **{key: cache})
    assert cache.get_seq_length() == 0 and cache.rollback is None
    out = _greedy(model, ids, 12, prompt_lookup_num_tokens=3, **{key: cache})
    assert out.shape[1] == ids.shape[1] + 12
