"""The projections back to the residual stream as inductor's GEMV (``ssm_spec.hf.narrow_gemv``):
which modules conversion swaps and gives back, the reduction form against ``F.linear``, the form
taken only where it applies (compiled, CUDA, half precision, one row), and a converted model's
compiled greedy with the form forced on the CPU equal to plain greedy."""

import contextlib

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


def _spy(monkeypatch):
    """Shapes traced through the reduction form."""
    traced = []
    monkeypatch.setattr(ng, "narrow_gemv", lambda x, w, b=None: traced.append(tuple(x.shape)) or narrow_gemv(x, w, b))
    return traced


def test_the_form_applies_only_in_the_loops_compiled_forwards_on_cuda_in_half_precision_to_one_row(monkeypatch):
    """With the CPU let in as a device (DEVICES), each other condition is checked for real: a
    one-row bf16 call compiled under inductor_forms takes the form; float32, two rows, a caller's
    own torch.compile (no inductor_forms) and eager calls keep F.linear's bits. Without the CPU
    in DEVICES, nothing on the CPU takes it."""
    torch.manual_seed(0)
    layer = NarrowLinear(48, 16, bias=True).to(torch.bfloat16)
    one, two = torch.randn(1, 1, 48, dtype=torch.bfloat16), torch.randn(1, 2, 48, dtype=torch.bfloat16)

    def run(x, forms=True, dtype=torch.bfloat16):
        torch._dynamo.reset()
        traced = _spy(monkeypatch)
        fn = torch.compile(layer.to(dtype), fullgraph=True, dynamic=False)
        with torch.no_grad(), (ng.inductor_forms() if forms else contextlib.nullcontext()):
            y = fn(x.to(dtype))
        return y, traced

    y, traced = run(one)
    assert traced == [] and torch.equal(y, F.linear(one, layer.weight, layer.bias))  # the CPU is not in DEVICES
    monkeypatch.setattr(ng, "DEVICES", ("cuda", "cpu"))
    y, traced = run(one)
    assert traced == [(1, 1, 48)]
    assert rel_err(y, F.linear(one.double(), layer.weight.double(), layer.bias.double())) < 1e-2
    for x, forms, dtype in ((two, True, torch.bfloat16), (one, False, torch.bfloat16), (one, True, torch.float32)):
        y, traced = run(x, forms, dtype)
        with torch.no_grad():
            assert traced == [] and torch.equal(y, F.linear(x.to(dtype), layer.weight, layer.bias)), (x.shape, forms, dtype)
    with ng.inductor_forms():
        assert not narrow_gemv_applies(one, layer.weight)  # eager: not compiling


def test_compiled_greedy_with_the_form_forced_equals_plain_greedy(monkeypatch):
    """The decode loop's compiled forwards (fullgraph) with the form let in on the CPU in fp32
    (DEVICES and DTYPES widened): batch 1 (one-row decode steps through it) and prompt lookup
    (windows through F.linear) give the unconverted model's greedy tokens."""
    monkeypatch.setattr(ng, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(ng, "DTYPES", (torch.bfloat16, torch.float16, torch.float32))
    traced = _spy(monkeypatch)
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
    """On CUDA under inductor_forms a compiled bf16 row is inductor's own reduction kernel (no
    cuBLAS mm in the generated code) and gives the product within bf16 rounding; two bf16 rows and
    one float32 row call cuBLAS."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    layer = NarrowLinear(in_features, out_features, bias=True).to("cuda", torch.bfloat16)

    def code_of(x):
        torch._dynamo.reset()
        with torch.no_grad(), ng.inductor_forms():
            return run_and_get_code(torch.compile(layer.to(x.dtype), fullgraph=True, dynamic=False), x)

    x = torch.randn(1, 1, in_features, device="cuda", dtype=torch.bfloat16)
    y, code = code_of(x)
    ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert rel_err(y, ref) < 1e-2
    assert not any("extern_kernels" in c and ("mm(" in c or "addmm(" in c) for c in code), code
    assert any("triton_red" in c or "triton_per" in c for c in code), code  # a reduction kernel
    for x in (torch.randn(1, 2, in_features, device="cuda", dtype=torch.bfloat16),
              torch.randn(1, 1, in_features, device="cuda", dtype=torch.float32)):
        _, code = code_of(x)
        assert any("extern_kernels" in c and ("mm(" in c or "addmm(" in c) for c in code), (x.shape, x.dtype)
