"""Hugging Face generate on converted Qwen3-Next / Qwen3.5 models (docs/design.md section 7).

Every speculative run is compared, token for token, with plain greedy ``generate`` on the
unconverted model (fp32; on CUDA too, where the GPU run executes this file). transformers'
own GDN path runs its PyTorch reference functions here (conftest), on every device.
"""

import re

import pytest
import torch
import transformers

from ssm_spec.hf import RecoverSSMCache, apply_recoverssm, cache_kwarg, tiny_model
from ssm_spec.hf.tiny import ByteTokenizer

KINDS = ["qwen3_next", "qwen3_5"]
TOK = ByteTokenizer()
PROMPT = "the cat sat on the mat. the cat sat on the"


def _ids(text=PROMPT, device="cpu"):
    return torch.tensor([TOK.encode(text)], device=device)


def _pair(kind, seed, device):
    """The unconverted model and a converted twin with the same weights."""
    return tiny_model(kind, seed=seed).to(device), apply_recoverssm(tiny_model(kind, seed=seed).to(device))


def _with(model, cache):
    """Pass ``cache`` under the name this transformers version uses (``cache`` from 5.2x on)."""
    return {cache_kwarg(model): cache}


def _greedy(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("kind", KINDS)
# seeds 1 and 2: the same path with other weights, on the first release only
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.hf_one_release) for s in (1, 2))])
def test_prompt_lookup_and_assistant_equal_plain_greedy(device, kind, seed):
    """256 new tokens: prompt lookup (5 and 3 drafts) and a converted assistant equal plain
    greedy generate of the unconverted model; the lookup runs accept drafts (the rollback is
    exercised with every crop depth), the assistant run is the model's noisy twin (partial
    acceptance, the heuristic draft length)."""
    ref, model = _pair(kind, seed, device)
    ids = _ids(device=device)
    plain = _greedy(ref, ids, 256)
    assert plain.shape[1] == ids.shape[1] + 256
    for k in (5, 3):
        cache = RecoverSSMCache(model)
        out = _greedy(model, ids, 256, prompt_lookup_num_tokens=k, **_with(model, cache))
        assert torch.equal(out, plain), (k, _first_diff(out, plain))
        assert cache.stats.accepted > 0
    draft = apply_recoverssm(tiny_model(kind, seed=seed).to(device))
    with torch.no_grad():  # a noisy twin: agrees often, not always
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(device) * 0.05 * p.std())
    draft.generation_config.num_assistant_tokens_schedule = "heuristic"
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0  # several 1-token forwards per round
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 256, assistant_model=draft, **_with(model, cache))
    assert torch.equal(out, plain), _first_diff(out, plain)
    assert 0 < cache.stats.accepted < cache.stats.drafted


@pytest.mark.parametrize("kind", KINDS)
def test_a_follow_up_turn_with_drafts_on_a_reused_cache_equals_a_fresh_one(kind):
    """A second ``generate`` with prompt lookup on the first one's output plus new text, with
    the same cache (transformers' assisted loop feeds its first forward the whole prompt, not
    only the tokens the cache lacks): every score equals the same turn's on a fresh cache bit
    for bit, and the acceptance stats add exactly what the fresh cache counts (the new prompt
    is not counted as accepted drafts). A plain follow-up turn (no drafts) reads only the new
    tokens and equals the unconverted model's greedy scores."""
    import copy

    ref, model = _pair(kind, 0, "cpu")
    cache = RecoverSSMCache(model)
    first = _greedy(model, _ids(), 30, prompt_lookup_num_tokens=4, **_with(model, cache))
    before = copy.deepcopy(cache.stats)
    follow = torch.cat([first, _ids(" and then the dog")], 1)
    scores = dict(return_dict_in_generate=True, output_scores=True)
    out = _greedy(model, follow, 30, prompt_lookup_num_tokens=4, **scores, **_with(model, cache))
    fresh = RecoverSSMCache(model)
    want = _greedy(model, follow, 30, prompt_lookup_num_tokens=4, **scores, **_with(model, fresh))
    assert torch.equal(out.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, want.scores))
    assert cache.get_seq_length() == fresh.get_seq_length()
    got = cache.stats
    assert (got.rounds - before.rounds, got.drafted - before.drafted, got.accepted - before.accepted) == \
        (fresh.stats.rounds, fresh.stats.drafted, fresh.stats.accepted), (before, got, fresh.stats)
    assert len(got.offered) == max(len(before.offered), len(fresh.stats.offered)) <= 4
    plain_cache = RecoverSSMCache(model)
    plain_first = _greedy(model, _ids(), 30, **_with(model, plain_cache))
    plain_follow = torch.cat([plain_first, _ids(" and then the dog")], 1)
    seen = plain_cache.get_seq_length()
    out = _greedy(model, plain_follow, 12, **scores, **_with(model, plain_cache))
    want = _greedy(ref, plain_follow, 12, **scores)
    assert torch.equal(out.sequences, want.sequences)
    assert plain_cache.get_seq_length() == seen + (plain_follow.shape[1] - seen) + 11  # only the new tokens read
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(out.scores, want.scores)) < 1e-5


def _first_diff(a, b):
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, :n] != b[0, :n]).nonzero()
    return int(diff[0]) if len(diff) else n


@pytest.mark.parametrize("kind", KINDS)
def test_model_as_its_own_draft_accepts_everything(device, kind):
    ref, model = _pair(kind, 4, device)
    draft = apply_recoverssm(tiny_model(kind, seed=4).to(device))
    draft.generation_config.assistant_confidence_threshold = 0.0  # draft the full length every round
    draft.generation_config.num_assistant_tokens = 6
    ids = _ids(device=device)
    plain = _greedy(ref, ids, 256)
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 256, assistant_model=draft, **_with(model, cache))
    assert torch.equal(out, plain)
    assert cache.stats.acceptance_rate > 0.98


def test_lookup_that_finds_nothing_runs_steps_without_drafts(device):
    """A prompt of distinct bytes: the first rounds have no drafts (a 1-token forward, then
    crop(0)); later the text loops and drafts appear. Still equal to plain greedy."""
    ref, model = _pair("qwen3_next", 0, device)
    ids = _ids("Qwerty! 1234567890 zxcvbnm", device)
    plain = _greedy(ref, ids, 256)
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 256, prompt_lookup_num_tokens=4, **_with(model, cache))
    assert torch.equal(out, plain)
    assert cache.stats.empty_rounds > 0 and cache.stats.drafted > 0


@pytest.mark.parametrize("max_new", [1, 2, 17, 30, 61])
def test_max_new_tokens_ending_mid_window(device, max_new):
    ref, model = _pair("qwen3_5", 2, device)
    ids = _ids(device=device)
    plain = _greedy(ref, ids, max_new)
    for kw in (dict(prompt_lookup_num_tokens=7),
               dict(assistant_model=apply_recoverssm(tiny_model("qwen3_5", seed=2).to(device)))):
        out = _greedy(model, ids, max_new, **kw)
        assert torch.equal(out, plain), (kw.keys(), max_new)


def test_eos_inside_an_accepted_window(device):
    """EOS is a token the greedy text reaches inside a looping stretch, where prompt lookup
    drafts (and accepts) past it: generation stops at the same EOS."""
    ref, model = _pair("qwen3_next", 0, device)
    ids = _ids(device=device)
    plain = _greedy(ref, ids, 256)[0, ids.shape[1]:].tolist()
    eos = plain[120]  # well inside the looping part
    stop = plain.index(eos)
    want = _greedy(ref, ids, 256, eos_token_id=eos)
    assert want.shape[1] == ids.shape[1] + stop + 1
    cache = RecoverSSMCache(model)
    out = _greedy(model, ids, 256, eos_token_id=eos, prompt_lookup_num_tokens=6, **_with(model, cache))
    assert torch.equal(out, want)
    out = _greedy(model, ids, 256, eos_token_id=eos,
                  assistant_model=apply_recoverssm(tiny_model("qwen3_next", seed=0).to(device)))
    assert torch.equal(out, want)


def test_sampling_with_self_draft_then_greedy_still_exact(device):
    """Sampling at temperature 1 with the model as its own draft: nearly every draft is
    accepted (speculative sampling with equal distributions); the same converted model then
    still decodes greedily exactly (no state leaks between generate calls)."""
    ref, model = _pair("qwen3_next", 3, device)
    draft = apply_recoverssm(tiny_model("qwen3_next", seed=3).to(device))
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.num_assistant_tokens = 5
    ids = _ids(device=device)
    torch.manual_seed(0)
    cache = RecoverSSMCache(model)
    out = model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=True, temperature=1.0, top_k=0, assistant_model=draft,
                         **_with(model, cache))
    assert out.shape[1] == ids.shape[1] + 128
    assert cache.stats.acceptance_rate >= 0.9, cache.stats
    assert torch.equal(_greedy(model, ids, 128, prompt_lookup_num_tokens=4), _greedy(ref, ids, 128))


def test_converted_model_as_assistant_of_another_model(device):
    """A Llama target (same byte vocabulary) with a converted Qwen3-Next assistant."""
    cfg = transformers.LlamaConfig(vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   eos_token_id=256, pad_token_id=257, bos_token_id=None)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(cfg).to(device).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(20)
    ids = _ids(device=device)
    plain = _greedy(target, ids, 64)
    draft = apply_recoverssm(tiny_model("qwen3_next", seed=0).to(device))
    assert torch.equal(_greedy(target, ids, 64, assistant_model=draft), plain)


def test_unconverted_gdn_assistant_is_refused():
    model = apply_recoverssm(tiny_model("qwen3_next", seed=0))
    with pytest.raises(ValueError, match="apply_recoverssm"):
        model.generate(_ids(), max_new_tokens=4, assistant_model=tiny_model("qwen3_next", seed=0))


@pytest.mark.parametrize("decode_loop", [True, False])
def test_draft_options_that_cannot_mean_what_they_say_are_refused(decode_loop):
    """Draft counts that are not integers >= 1 (0, 2.5, "5", True), a ``use_mtp`` that is not a
    bool, an assistant with prompt lookup (transformers' loop would draft by lookup and ignore
    the assistant), an assistant that is a name, not a model, and ``assistant_early_exit`` (the
    loop would ignore it and draft nothing) raise before
    anything runs, naming the option, in either loop; a numpy integer is a count."""
    model = apply_recoverssm(tiny_model("qwen3_5", seed=0), decode_loop=decode_loop)
    draft = apply_recoverssm(tiny_model("qwen3_5", seed=1))
    for kw, words in [(dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens=0;"),
                      (dict(prompt_lookup_num_tokens=2.5), "prompt_lookup_num_tokens=2.5;"),
                      (dict(prompt_lookup_num_tokens="5"), "prompt_lookup_num_tokens='5';"),
                      (dict(prompt_lookup_num_tokens=True), "prompt_lookup_num_tokens=True;"),
                      (dict(assistant_model=draft, num_assistant_tokens=-2), "num_assistant_tokens=-2;"),
                      (dict(assistant_model=draft, prompt_lookup_num_tokens=3), "one drafter per call"),
                      (dict(use_mtp="no"), "use_mtp='no';"), (dict(use_mtp=1), "use_mtp=1;"),
                      (dict(assistant_model="Qwen/Qwen3.5-0.8B"), "assistant_model is a str; expected a loaded"),
                      (dict(assistant_early_exit=2), "assistant_early_exit is not supported")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            model.generate(_ids(), max_new_tokens=3, do_sample=False, **kw)
    assert model._recoverssm.loop is None and model._recoverssm.last_stats is None
    import numpy as np

    assert model.generate(_ids(), max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=np.int64(2)).shape[1] > 0


def test_apply_recoverssm_refuses_what_is_not_a_model_or_a_switch():
    model = tiny_model("qwen3_5", seed=0)
    with pytest.raises(ValueError, match="apply_recoverssm: model: got a str"):
        apply_recoverssm("Qwen/Qwen3.5-4B")
    for name in ("cuda_graphs", "decode_loop", "fused_projections"):
        with pytest.raises(ValueError, match=f"apply_recoverssm: {name}: got 'yes'; expected True or False"):
            apply_recoverssm(model, **{name: "yes"})
    assert not hasattr(model, "_recoverssm")


@pytest.mark.parametrize("kind", KINDS)
def test_plain_generate_batch_with_left_padding(device, kind):
    ref, model = _pair(kind, 1, device)
    texts = ["the cat sat on the mat.", "a dog", "hello hello hello hello world"]
    width = max(len(TOK.encode(t)) for t in texts)
    ids = torch.full((3, width), TOK.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, t in enumerate(texts):
        enc = TOK.encode(t)
        ids[i, width - len(enc):] = torch.tensor(enc)
        mask[i, width - len(enc):] = 1
    ids, mask = ids.to(device), mask.to(device)
    plain = _greedy(ref, ids, 48, attention_mask=mask, pad_token_id=TOK.pad_token_id)
    out = _greedy(model, ids, 48, attention_mask=mask, pad_token_id=TOK.pad_token_id)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_without_cache_and_with_use_cache(device, kind):
    ref, model = _pair(kind, 0, device)
    ids = _ids(device=device)
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
        for kw in (dict(use_cache=False), dict(use_cache=True), {}):
            got = model(ids, **kw).logits
            assert ((got - want).double().norm() / want.double().norm()) < 1e-5, kw


def test_converting_twice_is_a_no_op_and_other_models_are_refused():
    model = apply_recoverssm(tiny_model("qwen3_next", seed=0))
    layers = [m for m in model.modules()]
    assert apply_recoverssm(model) is model and [m for m in model.modules()] == layers
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match="GatedDeltaNet"):
        apply_recoverssm(transformers.LlamaForCausalLM(cfg))


def test_converted_model_refuses_transformers_own_cache():
    model = apply_recoverssm(tiny_model("qwen3_next", seed=0))
    cache = transformers.DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="RecoverSSMCache"):
        model(_ids(), **_with(model, cache))


def test_copies_state_dicts_and_grad_mode(tmp_path):
    """A deep copy runs its own weights; state_dict keys and save_pretrained are HF's, so a
    converted model saves and reloads as the original; a forward in grad mode refuses."""
    import copy

    ref, model = _pair("qwen3_next", 0, "cpu")
    assert sorted(model.state_dict()) == sorted(ref.state_dict())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        assert not torch.equal(twin(_ids()).logits, model(_ids()).logits)
    ids = _ids()
    assert torch.equal(_greedy(twin, ids, 32, prompt_lookup_num_tokens=3), _greedy(twin, ids, 32))
    model.save_pretrained(tmp_path)
    reloaded = type(ref).from_pretrained(tmp_path).eval()
    assert torch.equal(_greedy(reloaded, ids, 48), _greedy(ref, ids, 48))
    with pytest.raises(ValueError, match="grad"):
        model(ids, use_cache=False)


def _top2_gap(model, prefix):
    """The unconverted model's top-1 minus top-2 logit after ``prefix [1, P]``."""
    with torch.no_grad():
        logits = model(prefix).logits[0, -1].double()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_transformers_own_prompt_lookup_departs_from_its_greedy_where_ours_does_not():
    """transformers 5.25 runs assisted decoding on GDN models itself (a history of recurrent
    states, ``crop`` restoring one). On the tiny fp32 models its prompt lookup departs from its
    own plain greedy at a token whose top-1/top-2 gap is far above fp32 rounding, while the
    converted model's prompt lookup equals plain greedy in every case (README: "Against
    transformers' own assisted decoding"). Releases that refuse assisted decoding on stateful
    models skip, with their refusal as the reason."""
    ids = _ids()
    departures = []
    for kind in KINDS:
        for seed in (0, 1):
            ref = tiny_model(kind, seed=seed)
            plain = _greedy(ref, ids, 120)
            try:
                own = _greedy(ref, ids, 120, prompt_lookup_num_tokens=5)
            except ValueError as exc:
                pytest.skip(f"transformers {transformers.__version__} refuses assisted decoding here: {exc}")
            if not torch.equal(own, plain):
                diff = _first_diff(own, plain)
                departures.append((kind, seed, diff - ids.shape[1], _top2_gap(ref, plain[:, :diff])))
            ours = _greedy(apply_recoverssm(ref), ids, 120, prompt_lookup_num_tokens=5)
            assert torch.equal(ours, plain), (kind, seed, _first_diff(ours, plain))
    # (kind, seed, first differing new token, plain model's top-1/top-2 gap there)
    assert departures and max(gap for *_, gap in departures) > 1e-2, (
        f"transformers {transformers.__version__}'s own prompt lookup now equals its greedy on the tiny models "
        f"({departures}): update the README's comparison")


@pytest.mark.parametrize("options", [dict(decode_loop=False), dict(decode_loop=False, cuda_graphs=True)])
@pytest.mark.parametrize("drafts", [{}, dict(prompt_lookup_num_tokens=3)])
def test_an_empty_prompt_is_refused_clearly_in_transformers_loop_too(options, drafts):
    """As the decode loop refuses one (tests/hf/test_decode_loop.py): before any forward runs,
    and the model generates as before afterwards (on CPU the graphed forward runs eagerly)."""
    ref, model = _pair("qwen3_next", 0, "cpu")
    apply_recoverssm(model, **options)
    forwards = []
    hook = model.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    with pytest.raises(ValueError, match=r"^generate: the prompt \(input_ids\) has no tokens"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4, **drafts)
    hook.remove()
    assert not forwards
    ids = _ids()
    assert torch.equal(_greedy(model, ids, 8, **drafts), _greedy(ref, ids, 8))


def test_a_forward_of_no_tokens_names_its_hidden_states():
    """Called directly (not through generate), an empty forward gets a clear message too, not
    torch.cat's."""
    model = apply_recoverssm(tiny_model("qwen3_next", seed=0))
    with pytest.raises(ValueError, match=r"hidden: got \[1, 0, \d+\]: a forward of no tokens"):
        model(torch.zeros(1, 0, dtype=torch.long), **_with(model, RecoverSSMCache(model)))


@pytest.mark.parametrize("name", ["cache_kwarg", "past_key_values"])
def test_a_cache_of_another_kind_is_refused_before_any_fallback_is_announced(name):
    """A transformers cache handed to a converted model: a ValueError naming its class, and no
    warning first that the call would run transformers' loop (it does not run at all)."""
    import warnings

    model = apply_recoverssm(tiny_model("qwen3_5", seed=0))
    key = cache_kwarg(model) if name == "cache_kwarg" else name
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values' deprecation on 5.25
        with pytest.raises(ValueError, match="got a DynamicCache; a converted model needs a RecoverSSMCache"):
            model.generate(_ids(), max_new_tokens=4, **{key: transformers.DynamicCache(config=model.config)})


def test_a_cache_made_for_another_model_is_refused_before_anything_runs():
    """A RecoverSSMCache of another converted model: one ValueError saying so, no fallback warning
    first (the state pool would otherwise fail inside transformers' loop)."""
    import warnings

    a, b = (apply_recoverssm(tiny_model("qwen3_5", seed=s)) for s in (0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(ValueError, match="made for another model"):
            b.generate(_ids(), max_new_tokens=4, **{cache_kwarg(b): RecoverSSMCache(a)})
    out = b.generate(_ids(), max_new_tokens=4, **{cache_kwarg(b): RecoverSSMCache(b)})  # its own cache runs
    assert out.shape[1] == _ids().shape[1] + 4
