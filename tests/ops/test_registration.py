"""torch.library registration: opcheck, torch.compile(fullgraph=True), no whole-pool copy."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from ssm_spec import ops
from tests.helpers import gdn_inputs, i32, qsl_from_lengths, random_pool, same_bits

HV, H, K, V = 4, 2, 16, 12
S = 11  # an odd slot count, so a pool-shaped buffer is easy to spot in generated code


def _gdn_args(device):
    gen = torch.Generator().manual_seed(0)
    inp = gdn_inputs(7, H, HV, K, V, device, gen=gen)
    pool = random_pool(S, HV, K, V, device, gen=gen)
    qsl = qsl_from_lengths([3, 0, 4], device)
    src = i32([0, -1, 4], device)
    return inp, pool, qsl, src


def _buffers(T, device):
    return (torch.empty(T, HV, V, device=device), torch.empty(T, HV, V, device=device),
            torch.empty(T, H, K, device=device), torch.empty(T, HV, device=device))


def test_opcheck_every_op(device):
    inp, pool, qsl, src = _gdn_args(device)
    T = inp.q.shape[0]
    out, ru, rk, rd = _buffers(T, device)
    torch.library.opcheck(torch.ops.ssm_spec.gdn_verify.default,
                          (*inp.args(), pool, src, qsl, out, ru, rk, rd, K**-0.5, True))
    n, dst = i32([2, 0, 4], device), i32([1, -1, 3], device)
    bidx, boff = i32([[5], [-1], [6]], device), i32([[1], [0], [2]], device)
    torch.library.opcheck(torch.ops.ssm_spec.gdn_commit.default,
                          (pool.clone(), ru, rk, rd, qsl, src, n, dst, bidx, boff))
    torch.library.opcheck(torch.ops.ssm_spec.gdn_commit.default,
                          (torch.stack([pool, pool]), torch.stack([ru, ru]), torch.stack([rk, rk]),
                           torch.stack([rd, rd]), qsl, src, n, dst, bidx, boff))
    snap = i32([7, 8, 9, -1, 10, -1, -1], device)
    torch.library.opcheck(torch.ops.ssm_spec.gdn_snapshot_verify.default,
                          (*inp.args(), pool.clone(), src, qsl, snap, out, K**-0.5, True))
    x = torch.randn(7, 10, device=device)
    w, b = torch.randn(10, 3, device=device), torch.randn(10, device=device)
    cs = torch.randn(S, 4, 10, device=device)
    rec_x = torch.empty(7, 10, device=device)
    for bias in (b, None):
        torch.library.opcheck(torch.ops.ssm_spec.short_conv_verify.default,
                              (x, w, bias, cs, src, qsl, torch.empty_like(x), rec_x, 2, "silu"))
    torch.library.opcheck(torch.ops.ssm_spec.short_conv_commit.default,
                          (cs.clone(), rec_x, qsl, src, n, dst, bidx, boff))


def _step(q, k, v, g, beta, pool, conv_pool, x, w, src, qsl, n, dst):
    """One layer's verify then commit, the way a module runs them."""
    out, record = ops.gdn_verify(q, k, v, g, beta, pool, src, qsl)
    y, rec_x = ops.short_conv_verify(x, w, None, conv_pool, src, qsl, dilation=2)
    ops.gdn_commit(pool, record, qsl, src, n, dst)
    ops.short_conv_commit(conv_pool, rec_x, qsl, src, n, dst)
    return out, y


def test_compile_fullgraph_equals_eager_without_pool_copy(device):
    inp, pool, qsl, src = _gdn_args(device)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 10, generator=gen).to(device)
    w = torch.randn(10, 3, generator=gen).to(device)
    conv_pool = torch.randn(S, 4, 10, generator=gen).to(device)
    n, dst = i32([2, 0, 3], device), i32([1, -1, 3], device)
    eager_pool, eager_conv = pool.clone(), conv_pool.clone()
    out_e, y_e = _step(*inp.args(), eager_pool, eager_conv, x, w, src, qsl, n, dst)
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    (out_c, y_c), code = run_and_get_code(compiled, *inp.args(), pool, conv_pool, x, w, src, qsl, n, dst)
    assert same_bits(out_c, out_e) and same_bits(y_c, y_e)  # every token is in a window
    assert same_bits(pool, eager_pool) and same_bits(conv_pool, eager_conv)
    source = "\n".join(code)
    for shape in (tuple(pool.shape), tuple(conv_pool.shape)):
        spelled = re.escape(str(shape))
        assert not re.search(r"empty_strided\w*\(" + spelled, source), f"a {shape} pool copy was allocated"
    assert "copy_(" not in source, "the compiled step copies a mutated buffer"


def test_compile_validation_is_off_and_no_graph_break(device):
    inp, pool, qsl, src = _gdn_args(device)
    counts = []

    def backend(gm, example_inputs):
        counts.append(sum(1 for node in gm.graph.nodes if node.op == "call_function"))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda *a: ops.gdn_verify(*a), backend=backend, fullgraph=True)
    out, _ = f(*inp.args(), pool, src, qsl)
    assert len(counts) == 1  # one graph: no break, no host read of the metadata
    ref, _ = ops.gdn_verify(*inp.args(), pool, src, qsl)
    assert torch.equal(out, ref)  # every token of qsl [0, 3, 3, 7] is in a live window


@pytest.mark.parametrize("op_name", ["gdn_verify", "gdn_commit", "gdn_snapshot_verify", "gdn_folded_verify",
                                     "short_conv_verify", "short_conv_commit"])
def test_schema_declares_mutation(op_name):
    schema = getattr(torch.ops.ssm_spec, op_name).default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    expected = {
        "gdn_verify": {"out", "rec_u", "rec_k", "rec_decay"},
        "gdn_commit": {"state"},
        "gdn_snapshot_verify": {"state", "out"},
        "gdn_folded_verify": {"state", "out", "rec_u", "rec_k", "rec_decay"},
        "short_conv_verify": {"out", "rec_x"},
        "short_conv_commit": {"conv_state"},
    }[op_name]
    assert mutated == expected
    assert len(schema.returns) == 0
