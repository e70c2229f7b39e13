"""Fused projections (:mod:`ssm_spec.hf.fused_linear`): linears reading one input run as one GEMM
under their own names. Outputs equal the separate projections' within rounding, every class's
groups are found, ``save_pretrained`` after conversion reloads into the unconverted class with
identical tensors, a moved model fuses again, and unfusing gives every weight its own storage."""

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from ssm_spec.hf import apply_recoverssm, recoverssm_config  # noqa: E402
from ssm_spec.hf.fused_linear import (SharedInputLinear, fuse_shared_input_linears, fused_groups,  # noqa: E402
                                      unfuse_shared_input_linears)
from ssm_spec.hf.tiny import KINDS, tiny_model  # noqa: E402

pytestmark = pytest.mark.hf

#: Groups per layer type a converted decoder layer must have fused: its mixer's and its MLP's.
EXPECTED = {
    "qwen3_next": ({"in_proj_qkvz", "in_proj_ba"}, {"q_proj", "k_proj", "v_proj"}),
    "qwen3_5": ({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}, {"q_proj", "k_proj", "v_proj"}),
}


class Owner(nn.Module):
    def __init__(self, widths, bias=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(24, w, bias=bias) for w in widths)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_group_equals_the_separate_projections(bias):
    """Three widths (one of a single column), any leading shape, with and without bias; called in
    another order, or one member on another tensor, each still gets its own projection."""
    torch.manual_seed(0)
    owner = Owner((40, 1, 16), bias=bias).double()
    ref = copy.deepcopy(owner)
    params = [p for p in owner.parameters()]
    assert fuse_shared_input_linears(owner) == 1
    assert [p for p in owner.parameters()] == params  # the same Parameter objects
    assert all(type(m) is SharedInputLinear and isinstance(m, nn.Linear) for m in (owner.q_proj, owner.k_proj))
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    for got, want in zip(owner(x), ref(x)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    y = torch.randn(3, 24, dtype=torch.float64)
    torch.testing.assert_close(owner.v_proj(x), ref.v_proj(x), rtol=1e-13, atol=1e-13)  # v first
    torch.testing.assert_close(owner.k_proj(y), ref.k_proj(y), rtol=1e-13, atol=1e-13)  # another input
    torch.testing.assert_close(owner.q_proj(y), ref.q_proj(y), rtol=1e-13, atol=1e-13)
    weight = owner.q_proj._fused_weight
    assert weight.shape == (57, 24) and all(m.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
                                            for m in (owner.q_proj, owner.k_proj, owner.v_proj))
    assert set(owner.state_dict()) == set(ref.state_dict())  # the fused buffer is not persistent


def test_fused_group_compiles_in_one_graph():
    owner = Owner((40, 8, 8))
    ref = copy.deepcopy(owner)
    fuse_shared_input_linears(owner)
    torch._dynamo.reset()
    compiled = torch.compile(owner, fullgraph=True)
    x = torch.randn(3, 24)
    for got, want in zip(compiled(x), ref(x)):
        torch.testing.assert_close(got, want)
    assert owner.k_proj._pending is None and owner.v_proj._pending is None  # nothing left behind


def test_unfusable_groups_are_left_alone():
    """A member of another in_features, a missing member, a subclass, a weight on meta: not fused."""
    owner = Owner((8, 8, 8))
    owner.v_proj = nn.Linear(12, 8)
    assert fuse_shared_input_linears(owner) == 0 and type(owner.q_proj) is nn.Linear
    del owner.v_proj
    assert fuse_shared_input_linears(owner) == 0
    with torch.device("meta"):
        meta = Owner((8, 8, 8))
    assert fuse_shared_input_linears(meta) == 0


def test_a_moved_model_fuses_again_and_unfusing_restores_own_weights():
    torch.manual_seed(1)
    owner = Owner((16, 8, 8))
    ref = copy.deepcopy(owner).double()
    fuse_shared_input_linears(owner)
    owner.double()  # replaces every parameter's tensor: the views no longer point at the fused weight
    x = torch.randn(2, 24, dtype=torch.float64)
    for got, want in zip(owner(x), ref(x)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    assert owner.q_proj._fused_weight.dtype == torch.float64
    assert owner.k_proj.weight.data_ptr() == owner.q_proj._fused_weight[16].data_ptr()
    assert unfuse_shared_input_linears(owner) == 1
    assert all(type(m) is nn.Linear for m in (owner.q_proj, owner.k_proj, owner.v_proj))
    ptrs = {m.weight.untyped_storage().data_ptr() for m in (owner.q_proj, owner.k_proj, owner.v_proj)}
    assert len(ptrs) == 3 and not list(owner.buffers())
    for got, want in zip(owner(x), ref(x)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_class_fuses_its_groups_and_saves_what_it_loaded(kind, tmp_path):
    """Every GDN layer's input projections, every attention's q/k/v and every MLP's gate/up
    (the shared expert's in the expert classes) are fused by the conversion;
    ``save_pretrained`` then writes the unconverted model's tensors under their names, which
    reload into the unconverted class identically; forward logits stay within rounding."""
    model = tiny_model(kind, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    apply_recoverssm(model)
    assert recoverssm_config(model).fused_projections
    names = [{n for n, c in m.named_children() if c in set(g)} for g in fused_groups(model)
             for m in model.modules() if g[0] in set(m.children())]
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    family = "qwen3_next" if kind.startswith("qwen3_next") else "qwen3_5"
    mixer, attention = EXPECTED[family]
    n_linear = sum(hasattr(layer, "linear_attn") for layer in layers)
    n_attn = len(layers) - n_linear
    n_mlp = sum(1 for m in model.modules() if isinstance(getattr(m, "gate_proj", None), SharedInputLinear))
    assert names.count(mixer) == n_linear and names.count(attention) == n_attn
    assert names.count({"gate_proj", "up_proj"}) == n_mlp >= len(layers)  # a dense MLP or a shared expert each
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert not fused_groups(reloaded)
    after = reloaded.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_switching_fusion_off_and_on_keeps_tokens():
    model = tiny_model("qwen3_5", seed=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    apply_recoverssm(model, fused_projections=False)
    assert not fused_groups(model)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3), want)
    apply_recoverssm(model, fused_projections=True)
    assert fused_groups(model)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3), want)
