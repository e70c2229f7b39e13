"""torch.export of the verify step and the functional verify ops; the Torch-TensorRT path where
torch_tensorrt imports (it cannot be installed in this project's test environments)."""

import pytest
import torch

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit, ops
from ssm_spec.export import VerifyForward, commit_records, example_inputs, export_verify
from tests.helpers import gdn_inputs, i32, qsl_from_lengths, random_pool, same_bits


def _stack(device, seed=0):
    torch.manual_seed(seed)
    layers = [RecoverGatedDeltaNet(32, 2, 4, 16, 16), RecoverShortConv(32, 3, dilation=2, bias=True),
              RecoverGatedDeltaNet(32, 2, 4, 16, 16, layout="qwen3_5")]
    return VerifyForward([layer.to(device) for layer in layers]).eval()


def _our_nodes(ep):
    return [n for n in ep.graph.nodes if n.op == "call_function" and str(n.target).startswith("ssm_spec.")]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("which", ["layer", "stack"])
def test_export_with_dynamic_dims_equals_eager(device, strict, which):
    module = _stack(device)
    if which == "layer":
        module = VerifyForward(module.layers[0])
    args = example_inputs(module, 6, [3, 1, 4], device=device)
    ep = export_verify(module, args, strict=strict)
    nodes = _our_nodes(ep)
    n_gdn = sum(isinstance(m, RecoverGatedDeltaNet) for m in module.layers)
    assert sum("gdn_verify_functional" in str(n.target) for n in nodes) == n_gdn  # one node per op call
    assert len(nodes) == 2 * n_gdn + (len(module.layers) - n_gdn)
    sym_T = _sym_T(ep)
    assert isinstance(sym_T, torch.SymInt)
    for n in nodes:  # fake shapes: every output's token dim is the symbolic T, the rest concrete
        for o in n.meta["val"]:
            assert str(o.shape[0]) == str(sym_T) and all(isinstance(d, int) for d in o.shape[1:])
    for slots_, lengths, seed in ((6, [3, 1, 4], 0), (6, [2, 5, 1, 3, 6], 1), (6, [7, 2], 2), (64, [1], 3),
                                  (3, [4], 4)):  # other T, B (1 included) and pool sizes S
        new = example_inputs(module, slots_, lengths, device=device, seed=seed)
        with torch.no_grad():
            got = ep.module()(*new)
            want = module(*new)
        assert same_bits(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            assert all(same_bits(x, y) for x, y in zip(a, b))


def _sym_T(ep):
    """The symbol of the hidden input's token dim."""
    placeholder = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "hidden")
    return placeholder.meta["val"].shape[0]


def test_exported_records_commit_like_the_module_step(device):
    """Verify through the exported program, commit its records with the in-place ops: the
    states equal the modules' own step (metadata, pool, commit), bit for bit."""
    module = _stack(device, seed=3)
    lengths, counts = [3, 1, 4], [2, 1, 4]
    args = example_inputs(module, 6, lengths, device=device, seed=3)
    hidden, gdn, conv, slots, qsl = args
    ep = export_verify(module, args)
    with torch.no_grad():
        out, records = ep.module()(*args)
    n = i32(counts, device)
    gdn_c, conv_c = [s.clone() for s in gdn], [s.clone() for s in conv]
    commit_records(module, records, gdn_c, conv_c, qsl, slots, n)
    pool = StatePool(list(module.layers), num_slots=6, max_tokens=8, device=device)
    gdn_in, conv_in = iter(gdn), iter(conv)
    for layer in module.layers:
        if isinstance(layer, RecoverGatedDeltaNet):
            pool.gdn_state(layer).copy_(next(gdn_in))
        pool.conv_state(layer).copy_(next(conv_in))
    md = RecoverSSMMetadata.build(lengths, [False] * 3, [5, 5, 5], slots.tolist(), num_slots=6, device=device)
    x = hidden
    with torch.no_grad():
        for layer in module.layers:
            x = x + layer(x, md, pool)
    commit(pool, md, n)
    assert same_bits(x, out)
    gdn_out, conv_out = iter(gdn_c), iter(conv_c)
    for layer in module.layers:
        if isinstance(layer, RecoverGatedDeltaNet):
            assert same_bits(pool.gdn_state(layer), next(gdn_out))
        assert same_bits(pool.conv_state(layer), next(conv_out))


def test_functional_ops_equal_the_in_place_ones_and_pass_opcheck(device):
    qsl = qsl_from_lengths([3, 0, 4], device)
    src = i32([2, -1, 0], device)
    inp = gdn_inputs(8, 2, 4, 16, 16, device)  # token 7 outside every window
    pool = random_pool(4, 4, 16, 16, device)
    out, rec = ops.gdn_verify(*inp.args(), pool, src, qsl)
    f_out, *f_rec = torch.ops.ssm_spec.gdn_verify_functional(*inp.args(), pool, src, qsl, 16**-0.5, True)
    live = slice(0, 7)
    assert same_bits(f_out[live], out[live]) and all(same_bits(a[live], b[live]) for a, b in zip(f_rec, rec))
    assert not f_out[7].any() and not f_rec[0][7].any()  # outside every window: zeros
    torch.library.opcheck(torch.ops.ssm_spec.gdn_verify_functional.default,
                          (*inp.args(), pool, src, qsl, 16**-0.5, True))
    x = torch.randn(8, 12).to(device)
    w = torch.randn(12, 3).to(device)
    conv = torch.randn(4, 4, 12).to(device)
    y, rec_x = ops.short_conv_verify(x, w, None, conv, src, qsl, dilation=2)
    f_y, f_rec_x = torch.ops.ssm_spec.short_conv_verify_functional(x, w, None, conv, src, qsl, 2, "silu")
    assert same_bits(f_y[live], y[live]) and same_bits(f_rec_x[live], rec_x[live])
    torch.library.opcheck(torch.ops.ssm_spec.short_conv_verify_functional.default,
                          (x, w, None, conv, src, qsl, 2, "silu"))


def test_tensorrt_compiles_the_exported_verify_where_installed():
    from ssm_spec import tensorrt

    ok, why = tensorrt.available()
    if not ok:
        pytest.skip(why)
    if not torch.cuda.is_available():
        pytest.skip("Torch-TensorRT needs a CUDA device")
    module = _stack("cuda")
    args = example_inputs(module, 6, [3, 1, 4], device="cuda")
    ep = export_verify(module, args)
    trt_module, placement = tensorrt.compile_verify(ep, list(_flat(args)))
    assert set(placement) == set(tensorrt.FUNCTIONAL_VERIFY_OPS)
    with torch.no_grad():
        got = trt_module(*_flat(args))
        want = module(*args)
    got0 = got[0] if isinstance(got, (tuple, list)) else got
    assert (got0.double() - want[0].double()).norm() / want[0].double().norm() < 1e-4


def _flat(args):
    hidden, gdn, conv, slots, qsl = args
    return (hidden, *gdn, *conv, slots, qsl)
