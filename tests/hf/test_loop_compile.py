"""The decode loop's verify forward under ``torch.compile(fullgraph=True)``: every published class
traces in one graph (no graph break), and later rounds and every layer reuse it (no recompile);
the compiled forward gives the eager one's logits within fp32 rounding (transformers' attention
takes another SDPA call while compiling: not bit for bit), and on CUDA, with inductor, greedy
tokens equal plain greedy."""

import pytest
import torch
from torch._dynamo.utils import counters

from ssm_spec.hf import apply_recoverssm, tiny_model
from ssm_spec.hf.loop.forward import LoopModel
from ssm_spec.hf.loop.rows import Rows
from ssm_spec.hf.tiny import KINDS, ByteTokenizer

TOK = ByteTokenizer()


def _target(kind, batch, window, prefill=True):
    model = apply_recoverssm(tiny_model(kind, seed=0).eval())
    target = LoopModel(model, batch, 64, window)
    rows = Rows(batch, 64, "cpu", pad_token_id=TOK.pad_token_id)
    if prefill:
        _load(target, rows)
    return target, rows


def _load(target, rows):
    """Rows of 10 tokens (the second left-padded by 3), prefilled, one token produced."""
    batch = rows.batch_size
    prompt = torch.randint(0, 256, (batch, 10), generator=torch.Generator().manual_seed(0))
    pad = torch.tensor([0, 3][:batch], dtype=torch.int64)
    prompt[1:, :3] = TOK.pad_token_id
    rows.load(prompt, pad, max_new=20, min_new=0, min_length=0)
    with torch.no_grad():
        target.prefill(rows, 10)
    rows.produced.fill_(1)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_verify_forward_compiles_in_one_graph_without_recompiles(kind):
    """Windows of 1 (a decode step) and 4 tokens, three rounds each with the state advancing:
    one graph per width, no graph break, no recompile, the eager logits within rounding."""
    torch._dynamo.reset()
    counters.clear()
    for window in (1, 4):
        target, rows = _target(kind, 2, window)
        compiled = torch.compile(target._forward, fullgraph=True, backend="eager")
        with torch.no_grad():
            for _ in range(3):
                columns = rows.window_columns(window)
                tokens = rows.window_tokens(columns)
                md = target.cache.verify_metadata(~rows.finished, window)
                target.cache.verify_step(md, columns)
                want = target._forward(tokens, columns, rows.pad, 0)
                got = compiled(tokens, columns, rows.pad, 0)
                err = float((got.double() - want.double()).norm() / want.double().norm())
                assert err < 1e-6, err
                target.commit(md, torch.ones(2, dtype=torch.int32))
                rows.produced += 1
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not counters["recompiles"], dict(counters["recompiles"])


def test_a_fresh_loop_cache_compiles_once_for_its_first_and_later_rounds():
    """The captured loop runs its first rounds on a fresh cache, before any prefill (padding rows
    only): that forward and the ones after the prefill share one graph. Attention buffers made
    lazily inside the first compiled call changed its guards, and the next call, the capture's
    checked warm-up, compiled again and synchronised there."""
    torch._dynamo.reset()
    counters.clear()
    target, rows = _target("qwen3_5", 2, 4, prefill=False)
    compiled = torch.compile(target._forward, fullgraph=True, backend="eager")

    def round_(n):
        columns = rows.window_columns(4)
        md = target.cache.verify_metadata(~rows.finished, 4)
        target.cache.verify_step(md, columns)
        compiled(rows.window_tokens(columns), columns, rows.pad, 0)
        target.commit(md, torch.full((2,), n, dtype=torch.int32))

    with torch.no_grad():
        rows.finished.fill_(True)
        round_(0)  # padding rows on a fresh cache, as the capture's first rounds
        _load(target, rows)
        round_(1)
        round_(1)
    # a guard that fails compiles the frame again without counting a "recompile"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_compiled_and_captured_loop_equals_plain_greedy(kind):
    """``compile=True`` with ``cuda_graphs=True`` on CUDA: inductor's forward inside the captured
    rounds; fp32 greedy tokens equal the unconverted model's, with prompt lookup, batch 2."""
    import warnings

    device = torch.device("cuda")
    ref = tiny_model(kind, seed=1).to(device)
    model = apply_recoverssm(tiny_model(kind, seed=1).to(device), cuda_graphs=True, compile=True)
    texts = ["the cat sat on the mat. the cat sat on the", "a b c a b c a b"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a capture that falls back to eager rounds fails
        for text in texts:
            ids = torch.tensor([TOK.encode(text)], device=device)
            want = ref.generate(ids, max_new_tokens=24, do_sample=False)
            got = model.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3)
            assert torch.equal(got, want)
            loop = model._recoverssm.loop
            assert loop.graph is not None and loop.replays > 0 and loop.eager_rounds == 0


def test_compiled_calls_of_other_widths_keep_the_eager_tokens_past_the_recompile_limit():
    """One compiled model, plain decoding then prompt lookup (two window widths), batch 3, with
    dynamo's recompile limit at 1: the second width compiles past the limit and both give the
    eager loop's tokens (a dynamic graph for the second width once wrote wrong records)."""
    torch._dynamo.reset()
    texts = ["the cat sat on the mat. the cat sat on the", "a b c a b c a b", "hello hello world, hello"]
    enc = [TOK.encode(t) for t in texts]
    P = max(map(len, enc))
    ids = torch.tensor([[TOK.pad_token_id] * (P - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in enc])
    compiled = apply_recoverssm(tiny_model("qwen3_5", seed=7), compile=True)
    eager = apply_recoverssm(tiny_model("qwen3_5", seed=7), compile=False)
    # dynamo's own patch, not pytest's monkeypatch: undoing that one deletes the setting, which
    # dynamo's config then hides from every later call in the process
    with torch._dynamo.config.patch(recompile_limit=1):
        for kw in ({}, {"prompt_lookup_num_tokens": 3}):
            want = eager.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **kw)
            assert torch.equal(compiled.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **kw),
                               want), kw
    assert torch._dynamo.config.recompile_limit == 8
    loop = compiled._recoverssm.loop  # the lookup call's: its search and bookkeeping compiled too
    assert loop.drafter._search is not type(loop.drafter)._propose and loop.rows._append is not type(loop.rows)._write
    assert eager._recoverssm.loop.drafter._search is type(loop.drafter)._propose


def test_an_assistant_converted_with_defaults_compiles_with_the_target_loop():
    """An assistant converted without options (``compile="auto"``, no graphs of its own) drafts
    inside the target's round: its verify forwards compile when the target's loop does, and
    otherwise as its own setting says (``compile=False``: eager, ``True``: compiled under an
    eager target); tokens equal plain greedy each time, and each rebuild frees the replaced loop's
    state pools, automatic garbage collection off (a compiled forward's trace leaves reference
    cycles that reach them)."""
    import weakref

    from ssm_spec.capture import collection_paused

    ids = torch.tensor([TOK.encode("the cat sat on the mat. the cat sat on the")])
    want = tiny_model("qwen3_5", seed=7).generate(ids, max_new_tokens=6, do_sample=False)
    torch._dynamo.reset()
    target = apply_recoverssm(tiny_model("qwen3_5", seed=7), compile=True)
    draft = apply_recoverssm(tiny_model("qwen3_5", seed=8))
    # (target's setting, assistant's setting, the assistant compiles); the same assistant object
    # throughout: a changed setting of either builds another loop
    replaced = []
    with collection_paused():  # what frees a replaced loop's pools is the rebuild, not an automatic collection
        for target_setting, setting, compiles in ((True, "auto", True), (True, False, False), (False, "auto", False),
                                                   (False, True, True)):
            apply_recoverssm(target, compile=target_setting)
            apply_recoverssm(draft, compile=setting)
            out = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=draft, num_assistant_tokens=1)
            assert torch.equal(out, want), (target_setting, setting)
            assert all(pool() is None for pool in replaced), (target_setting, setting)
            loop = target._recoverssm.loop
            lm = loop.drafter.model
            assert (lm._verify_forward is not LoopModel._forward) == compiles, (target_setting, setting)
            replaced = [weakref.ref(loop.target.cache.pool), weakref.ref(lm.cache.pool)]
            del loop, lm


def test_compile_auto_compiles_where_the_loop_captures():
    """``compile="auto"`` (the default): compiled when the loop captures CUDA graphs (cuda_graphs
    on a CUDA device), eager elsewhere; an explicit setting wins; other values are refused."""
    from ssm_spec.hf import RecoverSSMConfig

    auto = RecoverSSMConfig()
    assert auto.compile == "auto" and not auto.compiles_on("cuda") and not auto.compiles_on("cpu")
    graphed = auto.replace(cuda_graphs=True)
    assert graphed.compiles_on("cuda:0") and not graphed.compiles_on("cpu")
    assert not graphed.replace(compile=False).compiles_on("cuda") and auto.replace(compile=True).compiles_on("cpu")
    with pytest.raises(ValueError, match="compile"):
        RecoverSSMConfig(compile="yes")
    with pytest.raises(ValueError, match="apply_recoverssm: compile"):
        apply_recoverssm(tiny_model("qwen3_5"), compile="sometimes")
