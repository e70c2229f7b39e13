"""The projections back to the residual stream as inductor's GEMV (``ssm_spec.hf.narrow_gemv``):
which modules conversion swaps and gives back, the reduction form against ``F.linear``, the form
taken only where it applies (compiled, CUDA, half precision, one row), and a converted model's
compiled greedy with the form forced on the CPU equal to plain greedy."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ssm_spec.hf import apply_recoverssm, tiny_model
from ssm_spec.hf import narrow_gemv as ng
from ssm_spec.hf.narrow_gemv import NARROW_NAMES, NarrowLinear, narrow_gemv, narrow_gemv_applies
from ssm_spec.hf.tiny import KINDS, ByteTokenizer
from tests.helpers import rel_err


def _swapped(model):
    return sorted(n for n, m in model.named_modules() if type(m) is NarrowLinear)


@pytest.mark.parametrize("kind", KINDS)
def test_conversion_swaps_the_wider_projections_back_to_the_residual_stream_and_gives_them_back(kind):
    """Exactly the plain linears named as in NARROW_NAMES with hidden-size outputs from wider inputs
    become NarrowLinear (the dense MLPs' down_proj at the tiny widths; GDN's and attention's are
    square there), with the unconverted model's state dict, tensor for tensor; fused_projections=False
    gives nn.Linear back, True swaps them again."""
    ref = tiny_model(kind, seed=1)
    hidden = ref.config.get_text_config().hidden_size
    want = sorted(n for n, m in ref.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in NARROW_NAMES
                  and m.out_features == hidden < m.in_features)
    model = apply_recoverssm(tiny_model(kind, seed=1))
    assert _swapped(model) == want
    if "moe" not in kind:
        assert want, "a dense model has wider down projections"
    state = model.state_dict()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(state[name], tensor), name
    apply_recoverssm(model, fused_projections=False)
    assert _swapped(model) == [] and all(type(model.get_submodule(n)) is nn.Linear for n in want)
    apply_recoverssm(model, fused_projections=True)
    assert _swapped(model) == want


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (96,)])
def test_the_reduction_form_is_the_product_of_one_row(dtype, tol, shape):
    gen = torch.Generator().manual_seed(len(shape))
    w = torch.randn(40, 96, generator=gen).to(dtype)
    x = torch.randn(shape, generator=gen).to(dtype)
    y = narrow_gemv(x, w)
    assert y.shape == (*shape[:-1], 40) and y.dtype == dtype
    assert rel_err(y, x.double() @ w.double().T) < tol
    for bad in (torch.randn(2, 96).to(dtype), torch.randn(1, 95).to(dtype)):
        with pytest.raises(ValueError, match="expected one row of 96 inputs"):
            narrow_gemv(bad, w)


def test_the_form_applies_only_compiled_on_cuda_in_half_precision_to_one_row():
    """Eager calls, the CPU, float32 and several rows keep F.linear (its bits)."""
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert not narrow_gemv_applies(torch.randn(1, 16, dtype=torch.bfloat16), w)  # eager
    seen = []

    def probe(x):
        seen.append(narrow_gemv_applies(x, w))
        return x

    torch.compile(probe, fullgraph=True, backend="eager")(torch.randn(1, 16, dtype=torch.bfloat16))
    assert seen == [False]  # compiled, but on the CPU
    layer = NarrowLinear(16, 8, bias=True)
    x = torch.randn(3, 1, 16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def _forced(monkeypatch):
    """The form taken on the CPU too, wherever it otherwise applies (any float dtype)."""
    monkeypatch.setattr(ng, "narrow_gemv_applies",
                        lambda x, weight: torch.compiler.is_compiling() and x.numel() == x.shape[-1])


def test_a_compiled_narrow_linear_takes_the_form_and_gives_the_product(monkeypatch):
    """Forced on the CPU: compiled with fullgraph=True, one row gives F.linear's product within
    rounding (bias added), several rows F.linear's bits."""
    _forced(monkeypatch)
    torch.manual_seed(0)
    layer = NarrowLinear(48, 16, bias=True)
    compiled = torch.compile(layer, fullgraph=True)
    one, rows = torch.randn(1, 1, 48), torch.randn(1, 4, 48)
    with torch.no_grad():
        want = F.linear(one, layer.weight, layer.bias)
        assert rel_err(compiled(one), want) < 1e-6
        assert torch.equal(compiled(rows), F.linear(rows, layer.weight, layer.bias))


def test_compiled_greedy_with_the_form_forced_equals_plain_greedy(monkeypatch):
    """The decode loop's compiled forwards (fullgraph) with the form forced on the CPU in fp32:
    batch 1 (one-row decode steps through it) and prompt lookup (windows through cuBLAS) give
    the unconverted model's greedy tokens."""
    _forced(monkeypatch)
    traced = []  # shapes the compiled forwards traced through the form
    monkeypatch.setattr(ng, "narrow_gemv", lambda x, w: traced.append(tuple(x.shape)) or narrow_gemv(x, w))
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode("the cat sat on the mat. the cat sat on the")])
    ref = tiny_model("qwen3_5", seed=2)
    want = ref.generate(ids, max_new_tokens=10, do_sample=False)
    model = apply_recoverssm(tiny_model("qwen3_5", seed=2), compile=True)
    assert _swapped(model)
    for kw in ({}, {"prompt_lookup_num_tokens": 3}):
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, **kw), want), kw
        if not kw:
            assert traced and set(traced) == {(1, 1, ref.config.intermediate_size)}, traced


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("out_features,in_features", [(256, 1024), (2560, 9216)])
def test_on_cuda_a_compiled_bf16_row_runs_as_inductors_reduction(out_features, in_features):
    """On CUDA in bf16 the compiled one-row call is inductor's own kernel (no cuBLAS mm in the
    generated code) and gives the product within bf16 rounding; four rows call cuBLAS."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    layer = NarrowLinear(in_features, out_features, bias=False).to("cuda", torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(1, 1, in_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y, code = run_and_get_code(compiled, x)
        assert rel_err(y, x.double() @ layer.weight.double().T) < 1e-2
        assert not any("extern_kernels.mm" in c for c in code), code
        _, code = run_and_get_code(compiled, torch.randn(1, 4, in_features, device="cuda", dtype=torch.bfloat16))
        assert any("extern_kernels.mm" in c for c in code)
