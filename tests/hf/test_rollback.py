"""RecoverSSMCache / RollbackPool: the crops transformers makes roll every state back exactly."""

import pytest
import torch

from ssm_spec.hf import RecoverSSMCache, apply_recoverssm, cache_kwarg, tiny_model
from tests.helpers import FLA_PREFILL_TOL, prefill_uses_fla, rel_err


def _tol(device, exact):
    """``exact`` where every prompt runs the token loop; on CUDA with fla-core a fresh run's
    prompt goes through fla's chunked prefill while the cropped cache's tokens went through
    verify and commit, so they agree within FLA_PREFILL_TOL (the tiny models' head dim is 16)."""
    return FLA_PREFILL_TOL if prefill_uses_fla(device, (16,)) else exact


def _model(device, kind="qwen3_next", seed=0):
    return apply_recoverssm(tiny_model(kind, seed=seed).to(device))


def _states(cache):
    """Every state group's checkpoint slots (row b's checkpoint is slot b)."""
    rb = cache.rollback
    B = rb.batch_size
    return [s[:, :B].clone() for s, _ in (*rb.pool.gdn_groups.values(), *rb.pool.conv_groups.values())]


def _feed(model, cache, tokens, splits):
    """Forward ``tokens [1, N]`` in chunks of ``splits`` tokens; return the last logits."""
    key = cache_kwarg(model)
    at, logits = 0, None
    with torch.no_grad():
        for n in splits:
            logits = model(tokens[:, at:at + n], **{key: cache}).logits
            at += n
    return logits


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("splits,crop,max_pending", [
    ([45, 1, 1, 1, 1], 5, 6),    # an assistant: a prompt forward, four decode steps, crop into the prompt's tail
    ([45, 1, 1, 1, 1], 2, 2),    # ... with older pending tokens retired between forwards
    ([30, 6], 6, 6),             # a target round: the whole verify window rejected
    ([30, 6], 0, 6),             # ... all accepted (crop(0))
    ([37], 4, 5),                # the first forward carries the prompt and 4 drafts
    ([3], 2, 8),                 # a prompt shorter than max_pending: no prefill at all
    ([20, 2, 3, 4], 6, 9),       # three forwards, a crop reaching into the first of them
    ([37], 5, 5),                # a crop exactly max_pending deep after a prompt forward
    ([10, 60, 1], 2, 2),         # a long follow-up forward: prefilled too, only max_pending held
])
def test_crop_equals_a_fresh_run_of_the_kept_tokens(device, kind, splits, crop, max_pending):
    model = _model(device, kind)
    total = sum(splits)
    tokens = torch.randint(0, 256, (1, total + 3), generator=torch.Generator().manual_seed(total)).to(device)
    cache = RecoverSSMCache(model, max_pending=max_pending)
    _feed(model, cache, tokens, splits)
    held = 0
    for n in splits:  # at most max_pending tokens held after each forward, whatever its length
        held = min(held + n, max_pending)
    assert cache.rollback.pending == held
    assert cache.rollback.pool.max_tokens == max_pending  # records never grow past max_pending tokens
    cache.crop(-crop)
    kept = total - crop
    assert cache.get_seq_length() == kept
    fresh = RecoverSSMCache(model, max_pending=max_pending)
    _feed(model, fresh, tokens, [kept])
    fresh.crop(0)
    for got, want in zip(_states(cache), _states(fresh)):
        assert rel_err(got, want) < _tol(device, 1e-6)
    # and the next forward continues identically (the attention KV was cropped too)
    nxt = _feed(model, cache, tokens[:, kept:], [3])
    ref = _feed(model, fresh, tokens[:, kept:], [3])
    assert rel_err(nxt, ref) < _tol(device, 1e-5)


def test_crop_deeper_than_held_raises_and_changes_nothing(device):
    model = _model(device)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0)).to(device)
    cache = RecoverSSMCache(model, max_pending=3)
    _feed(model, cache, tokens, [16, 1, 1])  # 3 pending: the last token of the prompt forward and two steps
    before = _states(cache)
    seq = cache.get_seq_length()
    with pytest.raises(ValueError, match="only the last 3"):
        cache.crop(-4)
    assert cache.get_seq_length() == seq
    assert all(torch.equal(a, b) for a, b in zip(before, _states(cache)))
    cache.crop(torch.tensor(-3))  # transformers 5.17 passes a 0-d tensor
    assert cache.get_seq_length() == 15


def test_a_converted_draft_cache_after_generate_equals_a_fresh_run(device):
    """The assistant's own cache, taken from generate's output, rolled back to the tokens it
    kept: its states equal a fresh run over those tokens."""
    target, draft = _model(device, seed=1), _model(device, seed=1)
    apply_recoverssm(target, decode_loop=False)  # transformers' assisted loop drives the assistant's cache
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.num_assistant_tokens = 5
    with torch.no_grad():  # a noisy twin: rejections every few rounds
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(device) * 0.05 * p.std())
    from ssm_spec.hf.cache import RecoverSSMCache as Cache

    seen = []
    original = Cache.crop

    def spy(self, m):
        seen.append((self, int(m)))
        return original(self, m)

    ids = torch.tensor([list(b"the cat sat on the mat. the cat sat on the")], device=device)
    try:
        Cache.crop = spy
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=draft)
    finally:
        Cache.crop = original
    draft_caches = {id(c): c for c, _ in seen if c.adapters[0] in list(draft.modules())}
    assert len(draft_caches) == 1
    (dcache,) = draft_caches.values()
    assert any(m < -1 for c, m in seen if c is dcache)  # crops spanning several 1-token forwards
    n = dcache.get_seq_length()
    fresh = RecoverSSMCache(draft, max_pending=1)
    _feed(draft, fresh, out, [n])
    fresh.crop(0)
    dcache.crop(0)
    for got, want in zip(_states(dcache), _states(fresh)):
        assert rel_err(got, want) < _tol(device, 1e-6)


def test_beam_search_reorders_the_states(device):
    ref = tiny_model("qwen3_next", seed=2).to(device)
    model = _model(device, seed=2)
    ids = torch.tensor([list(b"the cat sat on the")], device=device)
    kw = dict(max_new_tokens=24, num_beams=3, do_sample=False, early_stopping=True)
    try:
        want = ref.generate(ids, **kw)
    except Exception as exc:  # transformers without beam search on this model: nothing to compare
        pytest.skip(f"plain beam search unavailable: {exc}")
    assert torch.equal(model.generate(ids, **kw), want)


def test_cache_arguments_are_validated():
    model = _model("cpu")
    with pytest.raises(ValueError, match="max_pending"):
        RecoverSSMCache(model, max_pending=0)
    with pytest.raises(ValueError, match="state_dtype"):
        RecoverSSMCache(model, state_dtype=torch.float16)
    cache = RecoverSSMCache(model, max_pending=4)
    _feed(model, cache, torch.randint(0, 256, (1, 9)), [9])
    with pytest.raises(ValueError, match="integer"):
        cache.crop(-1.5)
    cache.prompt_len = 3
    cache.reset()
    assert cache.prompt_len is None and cache.rollback is None
