"""ssm-spec's decode loop behind ``generate`` (docs/design.md section 7.7): every row of a batch
equals that row's own plain greedy ``generate`` of the unconverted model, token for token (fp32),
whatever the drafter and whatever the other rows do; the loop's prompt lookup proposes what
transformers' does; its speculative sampling is distributed as plain sampling; options it does
not implement run transformers' loop after one warning. On CUDA the same tests run the
captured rounds (``cuda_graphs=True``) against the eager loop.
"""

import warnings

import pytest
import torch

from ssm_spec.hf import acceptance_stats, apply_recoverssm, tiny_model
from ssm_spec.hf.loop import PromptLookup
from ssm_spec.hf.loop.rows import Rows
from ssm_spec.hf.loop.runner import PLAIN_ROUNDS_PER_GRAPH
from ssm_spec.hf.tiny import ByteTokenizer
from tests.helpers import widen_prompts

KINDS = ["qwen3_next", "qwen3_5"]
TOK = ByteTokenizer()
TEXTS = ["the cat sat on the mat. the cat sat on the", "a b c a b c a b", "hello hello world, hello", "xy"]


def _batch(texts, device="cpu"):
    """Left-padded ``(input_ids, attention_mask)`` of ``texts``."""
    enc = [TOK.encode(t) for t in texts]
    P = max(map(len, enc))
    ids = [[TOK.pad_token_id] * (P - len(e)) + e for e in enc]
    mask = [[0] * (P - len(e)) + [1] * len(e) for e in enc]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def _own(ref, texts, n, device, **kw):
    """Each text's plain greedy continuation on its own (the unconverted model, batch 1)."""
    return [ref.generate(torch.tensor([TOK.encode(t)], device=device), max_new_tokens=n, do_sample=False, **kw)[0]
            [len(TOK.encode(t)):] for t in texts]


def _noisy_twin(kind, seed, device, scale=0.05):
    draft = apply_recoverssm(tiny_model(kind, seed=seed).to(device))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(device) * scale * p.std())
    draft.generation_config.num_assistant_tokens = 4
    return draft


def _check_rows(out, prompt_len, own, pad_id):
    for b, tokens in enumerate(own):
        got = out[b, prompt_len:]
        assert torch.equal(got[:len(tokens)], tokens), (b, got.tolist(), tokens.tolist())
        assert (got[len(tokens):] == pad_id).all(), (b, got.tolist())


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_of_a_batch_equals_its_own_plain_greedy(device, kind):
    """Ragged prompts (one of two tokens), 37 new tokens (not a multiple of any window): plain
    decoding, prompt lookup and a converted assistant each give every row its own greedy."""
    ref = tiny_model(kind, seed=1).to(device)
    model = apply_recoverssm(tiny_model(kind, seed=1).to(device), cuda_graphs=device.type == "cuda")
    ids, mask = _batch(TEXTS, device)
    own = _own(ref, TEXTS, 37, device)
    draft = _noisy_twin(kind, 1, device)
    for kw in ({}, {"prompt_lookup_num_tokens": 3}, {"assistant_model": draft}):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback to transformers' loop
            out = model.generate(ids, attention_mask=mask, max_new_tokens=37, do_sample=False, **kw)
        _check_rows(out, ids.shape[1], own, TOK.pad_token_id)
        stats = acceptance_stats(model)
        if kw:
            assert stats.rounds > 0 and 0 < stats.accepted <= stats.drafted, (kw, stats)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_ending_early_at_eos_is_padded_while_the_others_go_on(device, kind):
    """An end-of-sequence id the model emits early in one row: that row stops there (the EOS
    kept, then padding), the others go on, each equal to its own greedy with the same EOS."""
    ref = tiny_model(kind, seed=2).to(device)
    model = apply_recoverssm(tiny_model(kind, seed=2).to(device))
    free = _own(ref, TEXTS[:3], 30, device)
    eos = int(free[1][6])  # row 1's seventh new token: it ends there (or earlier)
    ids, mask = _batch(TEXTS[:3], device)
    own = _own(ref, TEXTS[:3], 30, device, eos_token_id=eos)
    assert len(own[1]) <= 7 and max(map(len, own)) > 7
    for kw in ({}, {"prompt_lookup_num_tokens": 4}, {"assistant_model": _noisy_twin(kind, 2, device)}):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos, **kw)
        assert out.shape[1] == ids.shape[1] + max(map(len, own))
        _check_rows(out, ids.shape[1], own, TOK.pad_token_id)


class _Recorder:
    """A streamer (transformers' ``BaseStreamer`` protocol) that keeps what it is handed, and with
    ``model`` whether each put came while that model's decode loop still had rows running."""

    def __init__(self, model=None):
        self.puts, self.ended, self.model, self.running = [], False, model, []

    def put(self, value):
        self.puts.append(value.clone())
        loop = getattr(getattr(self.model, "_recoverssm", None), "loop", None)
        self.running.append(loop is not None and not bool(loop.rows.finished.all()))

    def end(self):
        self.ended = True


def test_a_streamer_gets_every_rows_steps_as_transformers_loop_streams_them(device):
    """A streamer at batch 3 with one row ending early at EOS: the prompt, then one ``[3]`` tensor a
    step (the ended row's pad id after its end), what transformers' own loop streams for the same
    call on the unconverted model, the first steps before the rows end; at batch 1 the new tokens,
    together the output's."""
    ref = tiny_model("qwen3_next", seed=2).to(device)
    model = apply_recoverssm(tiny_model("qwen3_next", seed=2).to(device))
    eos = int(_own(ref, TEXTS[:3], 12, device)[1][4])
    ids, mask = _batch(TEXTS[:3], device)
    theirs = _Recorder()
    ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, streamer=theirs,
                 pad_token_id=TOK.pad_token_id)
    assert len(theirs.puts) > 2 and all(p.shape == (3,) for p in theirs.puts[1:])
    for kw in ({}, {"prompt_lookup_num_tokens": 3}):
        ours = _Recorder(model)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                             streamer=ours, pad_token_id=TOK.pad_token_id, **kw)
        assert ours.ended and torch.equal(ours.puts[0], ids.cpu()), kw
        assert any(ours.running[1:]), kw  # steps handed over while rows still ran, not all at the end
        assert [p.tolist() for p in ours.puts[1:]] == [p.tolist() for p in theirs.puts[1:]], kw
        assert torch.equal(torch.stack(ours.puts[1:], 1), out[:, ids.shape[1]:].cpu()), kw
        one = _Recorder()
        alone = model.generate(ids[:1], max_new_tokens=12, do_sample=False, streamer=one, **kw)
        assert torch.equal(torch.cat(one.puts[1:]), alone[0, ids.shape[1]:].cpu()), kw


def test_min_new_tokens_holds_eos_back_inside_the_window(device):
    """``min_new_tokens`` masks the EOS at the window positions that are still short, as
    transformers' processor does token by token."""
    ref = tiny_model("qwen3_5", seed=2).to(device)
    model = apply_recoverssm(tiny_model("qwen3_5", seed=2).to(device))
    free = _own(ref, TEXTS[:1], 20, device)
    eos = int(free[0][3])
    own = _own(ref, TEXTS[:1], 20, device, eos_token_id=eos, min_new_tokens=9)
    ids, mask = _batch(TEXTS[:1], device)
    for kw in ({}, {"prompt_lookup_num_tokens": 5}):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                             min_new_tokens=9, **kw)
        _check_rows(out, ids.shape[1], own, TOK.pad_token_id)


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_run_wider_gives_every_row_its_own_greedy(device, kind, monkeypatch):
    """Under CUDA graphs the loop runs a prompt at a rounded-up width (more left padding, so that
    prompts of similar lengths share a captured prefill); forced here on any device, 13 columns
    wider: plain decoding, prompt lookup and an assistant give every row its own greedy, and
    ``min_length`` still counts the call's own prompt columns."""
    widen_prompts(monkeypatch, 13)
    ref = tiny_model(kind, seed=4).to(device)
    model = apply_recoverssm(tiny_model(kind, seed=4).to(device), cuda_graphs=device.type == "cuda")
    ids, mask = _batch(TEXTS[:3], device)
    own = _own(ref, TEXTS[:3], 25, device)
    for kw in ({}, {"prompt_lookup_num_tokens": 3}, {"assistant_model": _noisy_twin(kind, 4, device)}):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, **kw)
        _check_rows(out, ids.shape[1], own, TOK.pad_token_id)
        assert int(model._recoverssm.loop.rows.start[0]) == ids.shape[1] + 13
    P = len(TOK.encode(TEXTS[0]))
    eos = int(own[0][2])
    held = _own(ref, TEXTS[:1], 20, device, eos_token_id=eos, min_length=P + 9)
    assert len(held[0]) > 3  # min_length held the early end-of-sequence back
    ids, mask = _batch(TEXTS[:1], device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                         min_length=P + 9, prompt_lookup_num_tokens=3)
    _check_rows(out, P, held, TOK.pad_token_id)


def test_the_loops_candidates_are_transformers_prompt_lookup_candidates():
    """On random sequences with repeats (several n-gram sizes, matches near the end, an EOS
    inside a continuation, one token of budget left), the loop proposes exactly the drafts of
    transformers' ``PromptLookupCandidateGenerator``."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = torch.Generator().manual_seed(0)
    eos = torch.tensor([7])
    cases = 0
    for trial in range(300):
        L = int(torch.randint(2, 40, (1,), generator=gen))
        seq = torch.randint(0, 9, (1, L), generator=gen)  # a small alphabet: many repeats, some EOS (7)
        k = int(torch.randint(1, 7, (1,), generator=gen))
        n = int(torch.randint(1, 4, (1,), generator=gen))
        left = 1 if trial % 10 == 0 else 50  # new tokens still allowed
        theirs = PromptLookupCandidateGenerator(eos_token_id=eos, num_output_tokens=k, max_matching_ngram_size=n,
                                                max_length=L + left)
        cand, _ = theirs.get_candidates(seq)
        want = cand[0, L:].tolist()
        rows = Rows(1, 64, "cpu", pad_token_id=0)
        rows.load(seq, torch.zeros(1, dtype=torch.int64), max_new=left, min_new=0, min_length=0)
        drafts, count, _ = PromptLookup(k, n, eos).propose(rows)
        assert drafts[0, :int(count)].tolist() == want, (seq.tolist(), k, n, left)
        cases += bool(want)
    assert cases > 100  # most trials draft something


def test_compiled_lookup_drafts_what_the_eager_lookup_drafts():
    """``PromptLookup(compile=True)`` (what a compiled loop runs): the same drafts and counts as
    the eager search on batches of ragged, left-padded rows with EOS tokens and short budgets
    (one graph for every call of the bucket)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    eos = torch.tensor([7])
    eager, compiled = PromptLookup(4, 3, eos), PromptLookup(4, 3, eos, compile=True)
    rows = Rows(4, 48, "cpu", pad_token_id=0)
    drafted = 0
    for trial in range(40):
        pad = torch.randint(0, 8, (4,), generator=gen)
        seq = torch.randint(0, 9, (4, 24), generator=gen)
        seq[torch.arange(24)[None, :] < pad[:, None]] = 0
        rows.load(seq, pad, max_new=int(torch.randint(1, 6, (1,), generator=gen)), min_new=0, min_length=0)
        rows.produced.copy_(torch.randint(0, 3, (4,), generator=gen))
        want, got = eager.propose(rows), compiled.propose(rows)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial
        drafted += int(want[1].sum())
    assert drafted > 40
    assert dict(counters["stats"]).get("unique_graphs") == 1, dict(counters["stats"])


def test_options_the_loop_does_not_implement_run_transformers_loop_after_a_warning():
    """``output_scores`` (and beams): one RuntimeWarning naming the option, then transformers'
    loop on the converted cache, with the same tokens."""
    ref = tiny_model("qwen3_next", seed=3)
    model = apply_recoverssm(tiny_model("qwen3_next", seed=3))
    ids = torch.tensor([TOK.encode(TEXTS[0])])
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    with pytest.warns(RuntimeWarning, match="output_scores"):
        out = model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                             output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want) and out.scores is not None
    with pytest.warns(RuntimeWarning, match="num_beams"):
        model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    apply_recoverssm(model, decode_loop=False)  # transformers' loop, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), want)


def test_drafts_for_several_rows_that_only_transformers_loop_could_run_are_refused_by_cause():
    """Right padding or ``output_scores`` with drafts on 2 rows: the loop cannot run them and
    transformers' assisted loop drafts one row only, so the error names the cause, not the row
    count alone; without drafts, or with beams (transformers ignores the drafts there), the call
    falls back with a warning."""
    model = apply_recoverssm(tiny_model("qwen3_5", seed=0))
    ids, mask = _batch(TEXTS[:2])
    right = torch.ones_like(mask)
    right[1, -2:] = 0
    with pytest.raises(ValueError, match=r"right padding in the attention mask: .* one row only \(2 rows here\)"):
        model.generate(ids, attention_mask=right, max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match=r"output_scores"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=3,
                       output_scores=True, return_dict_in_generate=True)
    with pytest.warns(RuntimeWarning, match="right padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=3, do_sample=False)
    with pytest.warns(RuntimeWarning, match="num_beams"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, num_beams=2,
                             prompt_lookup_num_tokens=3)
    assert out.shape == (2, ids.shape[1] + 3)


def test_an_empty_prompt_is_refused_clearly():
    model = apply_recoverssm(tiny_model("qwen3_5", seed=0))
    with pytest.raises(ValueError, match="no tokens"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)


def test_calls_of_other_batch_sizes_and_drafts_reuse_or_rebuild_the_kept_loop(device):
    """A second call of the same bucket and drafter reuses the kept loop (and its graphs); another
    batch size or draft length builds a new one; every result stays exact."""
    ref = tiny_model("qwen3_next", seed=4).to(device)
    model = apply_recoverssm(tiny_model("qwen3_next", seed=4).to(device), cuda_graphs=device.type == "cuda")
    runtime = model._recoverssm
    seen = []
    for texts, k in ((TEXTS[:2], 3), (TEXTS[1:3], 3), (TEXTS[:3], 3), (TEXTS[:3], 2), (TEXTS[:1], 2)):
        ids, mask = _batch(texts, device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=17, do_sample=False,
                             prompt_lookup_num_tokens=k)
        _check_rows(out, ids.shape[1], _own(ref, texts, 17, device), TOK.pad_token_id)
        seen.append(runtime.loop)
    assert seen[0] is seen[1]  # same bucket (2 rows) and k
    assert seen[2] is not seen[1] and seen[3] is not seen[2] and seen[4] is not seen[3]
    if device.type == "cuda":
        assert all(loop.graph is not None and loop.eager_rounds == 0 for loop in seen)


def test_a_dropped_loop_or_cache_frees_its_state_buffers_at_once(monkeypatch):
    """The kept loop (plain, prompt lookup, a converted assistant) and the cache of a call through
    transformers' loop hold no reference cycle: dropping the last reference frees their state
    pools then, not at a later garbage-collection pass (a rebuilt loop's buffers are then free
    before the new ones are made)."""
    import weakref

    from ssm_spec.hf import cache as hf_cache
    from ssm_spec.capture import collection_paused

    model = apply_recoverssm(tiny_model("qwen3_5", seed=4))
    draft = _noisy_twin("qwen3_5", 5, torch.device("cpu"))
    ids, mask = _batch(TEXTS[:2])
    made = []
    init = hf_cache.RecoverSSMCache.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    with collection_paused():
        for kw in ({}, {"prompt_lookup_num_tokens": 3}, {"assistant_model": draft}):
            model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **kw)
            loop = model._recoverssm.loop
            pools = [weakref.ref(loop.target.cache.pool)]
            if kw.get("assistant_model") is not None:
                pools.append(weakref.ref(loop.drafter.model.cache.pool))
            del loop
            model._recoverssm.loop = None
            assert all(p() is None for p in pools), kw
        apply_recoverssm(model, decode_loop=False)
        monkeypatch.setattr(hf_cache.RecoverSSMCache, "__init__", recorded)
        model.generate(ids[:1], max_new_tokens=5, do_sample=False, prompt_lookup_num_tokens=3)
        assert len(made) == 1 and made[0]() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_captured_rounds_equal_the_eager_loop_and_a_failed_capture_is_loud():
    """On CUDA: the captured rounds and prompt parts give the eager loop's tokens for every drafter
    (batch 3; the prompt run 64 columns wide, the eager loop's at its own width); a
    model whose forward reads a value back on the host cannot be captured: one RuntimeWarning,
    then the same rounds run eagerly, with the same tokens."""
    device = torch.device("cuda")
    ids, mask = _batch(TEXTS[:3], device)
    graphed = apply_recoverssm(tiny_model("qwen3_5", seed=7).to(device), cuda_graphs=True)
    eager = apply_recoverssm(tiny_model("qwen3_5", seed=7).to(device), cuda_graphs=False)
    draft = _noisy_twin("qwen3_5", 7, device)
    # prompt lookup last: the longer prompt below runs in the loop it keeps (another drafter builds a new loop)
    for kw in ({}, {"assistant_model": draft}, {"prompt_lookup_num_tokens": 3}):
        a = graphed.generate(ids, attention_mask=mask, max_new_tokens=29, do_sample=False, **kw)
        b = eager.generate(ids, attention_mask=mask, max_new_tokens=29, do_sample=False, **kw)
        assert torch.equal(a, b), kw
        loop = graphed._recoverssm.loop
        assert loop.graph is not None and loop.replays > 0 and loop.eager_rounds == 0
        assert loop.prefill_failed is None and list(loop.prefill_graphs) == [64], kw  # the prompt's part captured
    longer, long_mask = _batch([TEXTS[0] * 2, *TEXTS[1:3]], device)  # 84 columns: a second width, 128
    kept = graphed._recoverssm.loop
    a = graphed.generate(longer, attention_mask=long_mask, max_new_tokens=29, do_sample=False, prompt_lookup_num_tokens=3)
    b = eager.generate(longer, attention_mask=long_mask, max_new_tokens=29, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(a, b) and graphed._recoverssm.loop is kept and sorted(kept.prefill_graphs) == [64, 128]
    graphed.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=True)
    sampling = graphed._recoverssm.loop  # kept: its graph draws, and is replayed after the failed capture
    assert sampling.graph is not None
    head = graphed.lm_head
    original = head.forward
    head.forward = lambda x: original(x) + 0 * float(x.sum())  # a host read inside the forward
    try:
        apply_recoverssm(graphed, cuda_graphs=False)
        # the eager forward, so that the host read meets the capture: compiled, dynamo's graph of
        # this forward from the calls above runs in place of the patched method
        apply_recoverssm(graphed, cuda_graphs=True, compile=False)
        with pytest.warns(RuntimeWarning, match="cannot be captured"):
            c = graphed.generate(ids, attention_mask=mask, max_new_tokens=29, do_sample=False,
                                 prompt_lookup_num_tokens=3)
    finally:
        head.forward = original
    assert torch.equal(c, eager.generate(ids, attention_mask=mask, max_new_tokens=29, do_sample=False,
                                         prompt_lookup_num_tokens=3))
    assert graphed._recoverssm.loop.eager_rounds > 0
    # the failed capture released the random generator: draws outside a capture, a graph
    # captured before that draws, and a new sampling call all still work
    torch.rand(4, device=device)
    sampling.graph.replay()
    torch.cuda.synchronize(device)
    sampled = graphed.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=True)
    assert sampled.shape[1] > ids.shape[1]


#: Operations that read device values back on the host: a synchronisation a captured round
#: cannot hold.
READ_BACKS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero",
              "repeat_interleave", "masked_scatter"}


def _host_ops_of(fn) -> dict:
    """``{op: count}`` of what ``fn()`` dispatches that synchronises on CUDA: the
    :data:`READ_BACKS`, and an ``index_put_`` of a tensor made from host data (``x[idx] = True``:
    on CUDA its value is copied from the host, a synchronising copy; a slice fill, ``x[..., :n] =
    0``, takes the scalar as it is). Inside a custom op nothing is seen: its CUDA kernel is not
    its CPU twin."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen, lifted = {}, set()

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            out = func(*args, **(kwargs or {}))
            if name in READ_BACKS:
                seen[name] = seen.get(name, 0) + 1
            elif name in ("lift_fresh", "lift_fresh_copy"):
                lifted.add(id(out))
            elif name in ("index_put", "index_put_", "_index_put_impl_") and id(args[2]) in lifted:
                seen["index_put of host data"] = seen.get("index_put of host data", 0) + 1
            return out

    with Watch(), torch.no_grad():
        fn()
    return seen


def test_a_round_reads_nothing_back_and_makes_no_tensor_from_host_data():
    """Every drafter's round and prompt part (prefill, first token, the drafter's start), with EOS held back by ``min_new_tokens`` and with sampling's warpers,
    dispatches no operation that synchronises on CUDA (a CPU check of what the CUDA capture
    refuses: ``mask[eos] = True`` once copied a host scalar to the device in every round)."""
    ids, mask = _batch(TEXTS[:2])
    model = apply_recoverssm(tiny_model("qwen3_5", seed=2))
    draft = _noisy_twin("qwen3_5", 2, "cpu")
    calls = [dict(do_sample=False), dict(do_sample=False, prompt_lookup_num_tokens=3),
             dict(do_sample=False, assistant_model=draft),
             dict(do_sample=True, top_k=5, top_p=0.9, temperature=0.7, prompt_lookup_num_tokens=3)]
    for kw in calls:
        model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, **kw)
        loop = model._recoverssm.loop
        assert loop.scoring.masks_eos, kw
        assert _host_ops_of(loop._rounds) == {}, kw
        width = ids.shape[1]
        assert _host_ops_of(lambda: loop._begin(width)) == {}, kw  # the prompt's part, captured per width


def test_streamer_gets_the_prompt_then_every_token():
    from transformers.generation.streamers import BaseStreamer

    class Keep(BaseStreamer):
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ref = tiny_model("qwen3_5", seed=5)
    model = apply_recoverssm(tiny_model("qwen3_5", seed=5))
    ids = torch.tensor([TOK.encode(TEXTS[0])])
    want = ref.generate(ids, max_new_tokens=20, do_sample=False)
    s = Keep()
    out = model.generate(ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=4, streamer=s)
    assert torch.equal(out, want) and s.ended
    assert s.parts[0] == ids[0].tolist() and sum(s.parts[1:], []) == want[0, ids.shape[1]:].tolist()
    # handed over as they come: at most one round's tokens (a window of 5) a put, the prefill's first alone
    assert len(s.parts[1]) == 1 and max(map(len, s.parts[1:])) <= 5, s.parts[1:]
    s = Keep()
    model.generate(ids, max_new_tokens=20, do_sample=False, streamer=s)
    assert sum(s.parts[1:], []) == want[0, ids.shape[1]:].tolist()
    assert max(map(len, s.parts[1:])) <= PLAIN_ROUNDS_PER_GRAPH, s.parts[1:]  # plain: one graph's rounds a put


def _exact_law(ref, ids, top_k, steps=3):
    """``{tokens: probability}`` of the first ``steps`` new tokens under top-k sampling
    (temperature 1), computed from the model's logits for every prefix in the support."""
    from transformers import TopKLogitsWarper

    warp = TopKLogitsWarper(top_k)
    law = {(): 1.0}
    for _ in range(steps):
        prefixes = list(law)
        seqs = torch.stack([torch.cat([ids[0], torch.tensor(p, dtype=torch.long)]) for p in prefixes])
        with torch.no_grad():
            logits = ref(seqs).logits[:, -1].double()
        probs = torch.softmax(warp(seqs, logits), -1)
        law = {(*p, t): law[p] * float(probs[i, t]) for i, p in enumerate(prefixes)
               for t in probs[i].nonzero()[:, 0].tolist()}
    return law


def _chi_square_p(counts: dict, law: dict, n: int) -> float:
    """The chi-square test's p-value of ``counts`` (``n`` draws) against ``law``; categories whose
    expected count is below 5 are pooled."""
    keys = sorted(law, key=law.get, reverse=True)
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for key in keys:
        e = law[key] * n
        if e >= 5:
            observed.append(counts.get(key, 0))
            expected.append(e)
        else:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + e
    if pool_e > 0:
        observed.append(pool_o + sum(v for k, v in counts.items() if k not in law))
        expected.append(pool_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2, dtype=torch.float64), stat / 2))


@pytest.mark.hf_one_release  # the rule's law on the second release: test_mtp.py's sampling test (the same acceptance)
def test_speculative_sampling_is_distributed_as_plain_sampling():
    """The joint law of the first three new tokens under top-3 sampling, computed exactly from
    the model, against the loop's draws without drafts, with prompt lookup and with an assistant
    (chi-square over 4,096 rows each, drawn 1,024 rows a call); the same test rejects draws from
    the law with 2 % of its mass moved from its likeliest outcome to another."""
    ref = tiny_model("qwen3_next", seed=6)
    model = apply_recoverssm(tiny_model("qwen3_next", seed=6))
    start = torch.tensor([TOK.encode("the cat sat")])
    ids = torch.cat([ref.generate(start, max_new_tokens=8, do_sample=False), start], 1)  # lookup drafts what it said
    law = _exact_law(ref, ids, top_k=3)
    rows, calls = 1024, 4
    n = rows * calls
    draft = _noisy_twin("qwen3_next", 6, "cpu", scale=0.3)
    draft.generation_config.num_assistant_tokens = 2
    torch.manual_seed(0)
    for kw in ({}, {"prompt_lookup_num_tokens": 2}, {"assistant_model": draft}):
        counts = {}
        for _ in range(calls):
            out = model.generate(ids.repeat(rows, 1), max_new_tokens=3, do_sample=True, top_k=3, top_p=1.0,
                                 temperature=1.0, **kw)
            for row in out[:, ids.shape[1]:].tolist():
                counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        if kw:
            stats = acceptance_stats(model)
            assert 0 < stats.accepted < stats.drafted, (kw, stats)  # drafts kept and refused: both paths run
        assert _chi_square_p(counts, law, n) > 1e-3, (kw, sorted(counts.items(), key=lambda x: -x[1])[:6])
    top, other = sorted(law, key=law.get, reverse=True)[:2]
    shifted = {**law, top: law[top] - 0.02, other: law[other] + 0.02}
    keys = list(shifted)
    draws = torch.multinomial(torch.tensor([shifted[k] for k in keys]), n, replacement=True,
                              generator=torch.Generator().manual_seed(1))
    counts = {}
    for i in draws.tolist():
        counts[keys[i]] = counts.get(keys[i], 0) + 1
    assert _chi_square_p(counts, law, n) < 1e-3


def test_the_loops_draft_length_where_num_assistant_tokens_is_left_at_its_default():
    """transformers' default ``num_assistant_tokens`` (20, which its own loop shortens round by
    round) drafts ``LOOP_NUM_ASSISTANT_TOKENS`` in the loop; a set value is kept; below 1 is refused."""
    from types import SimpleNamespace

    from ssm_spec.hf.loop import LOOP_NUM_ASSISTANT_TOKENS, draft_tokens

    assert draft_tokens(SimpleNamespace(num_assistant_tokens=20)) == LOOP_NUM_ASSISTANT_TOKENS
    assert draft_tokens(SimpleNamespace()) == LOOP_NUM_ASSISTANT_TOKENS
    assert draft_tokens(SimpleNamespace(num_assistant_tokens=7)) == 7
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_assistant_tokens"):
            draft_tokens(SimpleNamespace(num_assistant_tokens=bad))
    model = apply_recoverssm(tiny_model("qwen3_next", seed=1))
    draft = apply_recoverssm(tiny_model("qwen3_next", seed=2))
    ids, mask = _batch(TEXTS[:2], "cpu")
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant_model=draft)
    assert model._recoverssm.loop.k == LOOP_NUM_ASSISTANT_TOKENS


def test_an_attention_mask_that_is_not_the_prompts_is_refused_and_nothing_changes():
    """A mask of another shape, with values other than 0 and 1, or with a row of no tokens raises
    a ``ValueError`` naming ``attention_mask`` before anything runs (transformers' unconverted
    model fails inside a forward on the first, and reads the others differently); the model then
    generates as before."""
    ref = tiny_model("qwen3_5", seed=0)
    model = apply_recoverssm(tiny_model("qwen3_5", seed=0))
    ids, mask = _batch(TEXTS[:2])
    bad = [(mask[:, :3], r"attention_mask is \[2, 3\]; expected the prompt's shape"),
           (mask[:1], r"attention_mask is \[1, \d+\]"),
           (mask * 2, "values other than 0 and 1"),
           (torch.cat([mask[:1], torch.zeros_like(mask[1:])]), "row 1 has no tokens")]
    for drafts in ({}, {"prompt_lookup_num_tokens": 3}):
        for m, words in bad:
            with pytest.raises(ValueError, match=words):
                model.generate(ids, attention_mask=m, max_new_tokens=4, do_sample=False, **drafts)
    assert model._recoverssm.loop is None
    _check_rows(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), ids.shape[1],
                _own(ref, TEXTS[:2], 6, "cpu"), TOK.pad_token_id)


@pytest.mark.parametrize("decode_loop", [True, False])
def test_a_draft_length_past_the_token_budget_is_cut_to_it(decode_loop):
    """``prompt_lookup_num_tokens=100000`` for a 5-token call asked for gigabytes of buffers
    and verify columns; now the decode loop drafts at most the budget a round, transformers' loop
    (whose prompt lookup proposes up to the sequence's length) rolls back at most the longest
    sequence, and both give plain greedy's tokens; a later call with a larger budget drafts more."""
    ref = tiny_model("qwen3_next", seed=0)
    model = apply_recoverssm(tiny_model("qwen3_next", seed=0), decode_loop=decode_loop)
    ids = torch.tensor([TOK.encode(TEXTS[0])])
    for n in (5, 9):
        out = model.generate(ids, max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=100_000)
        assert torch.equal(out, ref.generate(ids, max_new_tokens=n, do_sample=False))
        stats = acceptance_stats(model)
        assert stats is not None and stats.rounds >= 1
        if decode_loop:
            assert model._recoverssm.loop.drafter.k == n and stats.drafted <= n * stats.rounds
        else:
            out = model.generate(ids, max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=100_000,
                                 return_dict_in_generate=True)
            assert out.past_key_values.max_pending <= ids.shape[1] + n + 1



def test_acceptance_counts_only_drafts_inside_the_token_budget():
    """The loop's window keeps its width in a row's last round, but transformers never drafts past
    ``max_new_tokens``: the counters leave those drafts out, so every round's kept tokens are its
    counted accepted drafts plus one, and ``rounds + accepted`` is the new tokens after the
    prefill's, whatever was accepted (no EOS here); a round with one token left counts no draft."""
    model = apply_recoverssm(tiny_model("qwen3_5", seed=5))
    model.generation_config.eos_token_id = None
    ids = torch.tensor([TOK.encode(TEXTS[0])])
    for kw in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": model, "num_assistant_tokens": 4}):
        for n in (2, 7, 14):
            out = model.generate(ids, max_new_tokens=n, do_sample=False, **kw)
            assert out.shape[1] - ids.shape[1] == n
            stats = acceptance_stats(model)
            assert stats.rounds + stats.accepted == n - 1, (kw, n, stats)
            # positions offered: up to the budget (an assistant drafts every one; lookup where it matches)
            offered = len(stats.position_rates)
            assert stats.drafted <= 4 * stats.rounds and offered <= min(4, n - 2), (kw, n, stats)
            if "assistant_model" in kw:
                assert offered == min(4, n - 2), (n, stats)
            if n == 2:
                assert stats.rounds == stats.empty_rounds == 1 and stats.drafted == 0 == len(stats.offered), (kw, stats)
        if "assistant_model" in kw:  # the model drafting for itself is accepted throughout
            assert stats.accepted == stats.drafted > 0, stats


def test_transformers_text_streamers_run_with_the_byte_tokenizer():
    """TextIteratorStreamer (which decodes single ids and passes decode options) over the loop's
    puts, plain and with prompt lookup: the text it yields is the output's new tokens decoded."""
    from transformers import TextIteratorStreamer

    model = apply_recoverssm(tiny_model("qwen3_5", seed=5))
    ids = torch.tensor([TOK.encode(TEXTS[0])])
    for kw in ({}, {"prompt_lookup_num_tokens": 3}):
        streamer = TextIteratorStreamer(TOK, skip_prompt=True, skip_special_tokens=True)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, streamer=streamer, **kw)
        assert "".join(streamer) == TOK.decode(out[0, ids.shape[1]:]), kw
    assert TOK.decode(104) == "h" and TOK.decode([104, 105], skip_special_tokens=True) == "hi"
