"""Every published Qwen3-Next / Qwen3.5 model class through ``apply_recoverssm`` (CPU, fp32):
Qwen3-Next with dense and with expert MLPs, Qwen3.5, Qwen3.5-MoE and the vision-language
Qwen3.5 and Qwen3.5-MoE (text prompts). Prompt lookup and an assistant give plain greedy's tokens; a saved
checkpoint of each loads through ``AutoModelForCausalLM`` and the CLI's ``--model``; image inputs
are refused."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ssm_spec.hf import acceptance_stats, apply_recoverssm, kept_cache  # noqa: E402
from ssm_spec.hf.tiny import KINDS, tiny_model  # noqa: E402
from tests.helpers import first_divergence  # noqa: E402
from tests.hf.test_cli_generate import _assert_ok_and_equal, _run  # noqa: E402
from tests.hf.test_decode_loop import _noisy_twin  # noqa: E402

PROMPT = torch.tensor([list(b"def add(x, y):\n    return x + y\n\ndef add(x, y):\n    return")])
NEW = 256
NEW_KINDS = ["qwen3_next_moe", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"]  # the dense ones: tests/hf/test_generate.py


def test_kinds_cover_every_published_class():
    assert set(KINDS.values()) == {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                   "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}
    with pytest.raises(ValueError, match="kind"):
        tiny_model("qwen4")


@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_kernels_switch_covers_every_class(kind):
    """``hf_reference_kernels`` (the tests' autouse switch to transformers' PyTorch functions, and
    the benchmark's hf-torch baseline) unwraps the functions of every class's modeling module:
    Qwen3.5-MoE binds its own copies, which a list of two families once left on fla-core. Without
    fla-core (CPU) the functions are plain either way and only the family check can fail; with it
    (the GPU suite) the unwrap check reads what the switch left bound."""
    import importlib
    import inspect

    from ssm_spec.hf.kernels import HF_KERNEL_FUNCTIONS, HF_MODELING, hf_reference_kernels

    module = importlib.import_module(type(tiny_model(kind).get_decoder().layers[0].linear_attn).__module__)
    family = module.__name__.rsplit(".", 2)[-2]
    assert family in HF_MODELING, family
    with hf_reference_kernels():  # nested in conftest's: still the plain functions inside
        for fn in HF_KERNEL_FUNCTIONS:
            if hasattr(module, fn):
                assert inspect.unwrap(getattr(module, fn)) is getattr(module, fn), (family, fn)


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_every_class_generates_plain_greedys_tokens(kind):
    """256 new tokens, expert layers on: plain converted ``generate``, prompt lookup and an
    assistant of the same class give the unconverted model's greedy tokens (fp32). The assistant
    is the model's noisy twin, so its drafts are both accepted and refused (a random one of
    another seed had every draft refused: 255 four-token rounds, 2-3x the twin's time)."""
    model = tiny_model(kind, seed=1)
    assert type(model).__name__ == KINDS[kind]
    if "moe" in kind:
        assert any("experts" in name for name, _ in model.named_modules()), "expert layers must be on"
    want = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    converted = apply_recoverssm(copy.deepcopy(model))
    calls = [{}, {"prompt_lookup_num_tokens": 3},
             {"assistant_model": _noisy_twin(kind, 1, "cpu", scale=0.2)}]  # an assistant of the same class
    for kwargs in calls:
        got = converted.generate(PROMPT, max_new_tokens=NEW, do_sample=False, **kwargs)
        assert torch.equal(got, want), (kind, list(kwargs))
    stats = acceptance_stats(converted)
    assert 0 < stats.accepted < stats.drafted, (kind, stats)


@pytest.mark.parametrize("kind", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vision_language_class_refuses_image_inputs_and_keeps_the_tower(kind):
    model = tiny_model(kind, seed=1)
    tower = {name: p.clone() for name, p in model.named_parameters() if "visual" in name}
    assert tower, "the vision tower is part of the model"
    converted = apply_recoverssm(model)
    with pytest.raises(ValueError, match="text prompts only"):
        converted.generate(PROMPT, max_new_tokens=2, pixel_values=torch.zeros(4, 8))
    assert all(torch.equal(p, tower[name]) for name, p in converted.named_parameters() if "visual" in name)
    assert not any("linear_attn" in name and "visual" in name for name, _ in converted.named_modules())


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_saved_checkpoint_loads_through_auto_and_the_cli(kind, tmp_path):
    """``AutoModelForCausalLM`` on a saved checkpoint of each class (the vision-language ones load
    as their text models, ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``) converts and matches greedy; the CLI's ``--model``
    runs each end to end (``--check``: tokens equal plain greedy)."""
    model = tiny_model(kind, seed=4)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True,
                                                               dtype=torch.float32).eval()
    assert type(loaded).__name__ == KINDS[kind].replace("ForConditionalGeneration", "ForCausalLM")
    want = loaded.generate(PROMPT, max_new_tokens=12, do_sample=False)
    got = apply_recoverssm(loaded).generate(PROMPT, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)
    proc = _run("--model", tmp_path, "--max-new-tokens", 16, "--check", "--warmup", 0, "--device", "cpu",
                "--repeats", 1)
    _assert_ok_and_equal(proc)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next_moe", "qwen3_5_moe_vl"])
def test_cuda_graphs_switch_experts_to_batched_mm_and_back(kind):
    """``cuda_graphs=True`` runs the expert layers through transformers' ``batched_mm`` (routing
    on the device, shapes fixed by the token count: capture-safe); turning graphs off restores
    the model's own setting; tokens stay plain greedy's (the graphed path runs eagerly on CPU)."""
    from ssm_spec.hf.experts import CAPTURE_SAFE_EXPERTS

    model = tiny_model(kind, seed=1)
    own = model.get_experts_implementation()
    reference = copy.deepcopy(model)
    reference.set_experts_implementation(CAPTURE_SAFE_EXPERTS)
    want = reference.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    converted = apply_recoverssm(model, cuda_graphs=True)
    assert set(converted.get_experts_implementation().values()) == {CAPTURE_SAFE_EXPERTS}
    got = converted.generate(PROMPT, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)
    apply_recoverssm(converted, cuda_graphs=False)
    assert converted.get_experts_implementation() == own
    dense = apply_recoverssm(tiny_model("qwen3_5"), cuda_graphs=True)  # no expert layer: untouched
    assert dense.get_experts_implementation() == tiny_model("qwen3_5").get_experts_implementation()


@pytest.mark.parametrize("kind", list(KINDS))
def test_bf16_tokens_agree_with_plain_greedy_up_to_the_first_near_tie(kind):
    """bf16 end to end (weights, activations and states): converted prompt lookup gives plain
    greedy's tokens up to the first near-tie of plain greedy's logits, a top-2 gap within 4 bf16
    ulps of the top logit (the layers round differently from transformers' own in bf16); the
    position and gap are printed (measured on the CPU: Qwen3-Next parts at new token 67, gap
    2^-6; its MoE at 38, 2^-5; the Qwen3.5 VL text model at 115, a tie; Qwen3.5, Qwen3.5-MoE and
    the Qwen3.5-MoE VL text model agree over all 128)."""
    model = tiny_model(kind, seed=1).to(torch.bfloat16)
    plain = model.generate(PROMPT, max_new_tokens=128, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    got = apply_recoverssm(copy.deepcopy(model), state_dtype=torch.bfloat16).generate(
        PROMPT, max_new_tokens=128, do_sample=False, prompt_lookup_num_tokens=3)
    parted = first_divergence(plain, got, PROMPT.shape[1])
    if parted is not None:
        p, top = parted
        ulp = 2.0 ** (torch.floor(torch.log2(top[0].abs().clamp_min(2.0**-100))).item() - 7)
        print(f"{kind}: bf16 parts from plain greedy at new token {p}, logit gap {float(top[0] - top[1]):.4g}")
        assert float(top[0] - top[1]) <= 4 * ulp, (p, float(top[0] - top[1]), ulp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_class_captures_on_cuda_and_replays_the_eager_logits(kind):
    """On CUDA with ``cuda_graphs=True`` (fp32): capture never falls back (its warning is an
    error here), prompt lookup and an assistant give plain greedy's tokens of the unconverted
    model (expert layers through the capture-safe implementation in both), and the replayed
    forwards give the eager body's logits bit for bit."""
    import warnings

    from ssm_spec.hf.experts import CAPTURE_SAFE_EXPERTS

    device = torch.device("cuda")
    prompt = PROMPT.to(device)
    reference = tiny_model(kind, seed=1).to(device)
    if "moe" in kind:
        reference.set_experts_implementation(CAPTURE_SAFE_EXPERTS)
    want = reference.generate(prompt, max_new_tokens=NEW, do_sample=False)
    logits = []
    for capture in (True, False):
        # transformers' own loop with graphed forwards (output_logits is for that loop alone)
        model = apply_recoverssm(tiny_model(kind, seed=1).to(device), cuda_graphs=True, decode_loop=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            # keeps a cache sized for the calls below (a longer call would keep a new one, capture on)
            model.generate(prompt, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3)
            graphed = kept_cache(model).graphed
            graphed.capture = capture
            before = graphed.replays
            out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3,
                                 output_logits=True, return_dict_in_generate=True)
            assert torch.equal(out.sequences, want), (kind, capture)
            assert kept_cache(model).graphed is graphed
            assert graphed.failed is None and (graphed.replays > before) == capture
            logits.append(torch.cat(out.logits))
            if capture:
                assistant = apply_recoverssm(tiny_model(kind, seed=2).to(device), cuda_graphs=True,
                                             decode_loop=False)
                got = model.generate(prompt, max_new_tokens=NEW, do_sample=False, assistant_model=assistant)
                assert torch.equal(got, want), (kind, "assistant")
    assert torch.equal(logits[0], logits[1])
    # the decode loop's captured rounds, compiled forward inside, on the same class
    looped = apply_recoverssm(tiny_model(kind, seed=1).to(device), cuda_graphs=True, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for kw in ({}, {"prompt_lookup_num_tokens": 3}):
            assert torch.equal(looped.generate(prompt, max_new_tokens=NEW, do_sample=False, **kw), want), (kind, kw)
            loop = looped._recoverssm.loop
            assert loop.graph is not None and loop.replays > 0 and loop.eager_rounds == 0, (kind, kw)
