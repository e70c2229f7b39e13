"""``RecoverGatedDeltaNet.prefill_padded``: left-padded rows of one width, prefilled with fixed
shapes (the decode loop's captured prefill), against :meth:`forward`'s per-row prefill of each
row's real tokens alone."""

import pytest
import torch
from torch import nn

from ssm_spec import RecoverGatedDeltaNet, RecoverSSMMetadata, StatePool
from tests.helpers import FLA_PREFILL_TOL, prefill_uses_fla, rel_err, same_bits


def _layer(layout, head_dims, device, conv_bias):
    torch.manual_seed(3)
    K, V = head_dims
    layer = RecoverGatedDeltaNet(32, 2, 4, K, V, layout=layout)
    if conv_bias:  # a padding column's conv output is then not zero: only its beta and decay keep it out
        layer.conv1d.bias = nn.Parameter(torch.zeros(layer.conv1d.out_channels))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
        layer.A_log.uniform_(-1, 1)
    return layer.to(device).eval()


def _states(pool):
    return [s for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())]


@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("head_dims", [(8, 6), (16, 32)])  # (16, 32): fla-core's chunked prefill on CUDA
@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_padded_rows_equal_each_rows_own_prefill(device, layout, head_dims, conv_bias):
    """Rows of 11 columns with 0, 4 and 10 padding columns and one without real tokens, written
    to scattered slots of a poisoned pool: each row's outputs and final states are those of its
    real tokens prefilled alone; padding columns come out zero, a row without tokens gets zero
    states, the other slots keep their bits. The input is a non-contiguous view."""
    layer = _layer(layout, head_dims, device, conv_bias)
    B, L = 4, 11
    pads = [0, 4, 10, L]
    hidden = torch.randn(L, B, 32, device=device).transpose(0, 1)  # [B, L, 32], not contiguous
    valid = torch.arange(L, device=device)[None, :] >= torch.tensor(pads, device=device)[:, None]
    slots = torch.tensor([5, 1, 3, 6], device=device)
    pool = StatePool([layer], num_slots=8, max_tokens=4, device=device)
    for s in _states(pool):
        s.normal_()
    before = [s.clone() for s in _states(pool)]
    with torch.no_grad():
        out = layer.prefill_padded(hidden, valid, pool, slots)
    tol = FLA_PREFILL_TOL if prefill_uses_fla(device, head_dims) else 1e-5
    assert out.shape == (B, L, 32) and out.dtype == hidden.dtype
    for b, pad in enumerate(pads):
        assert (out[b, :pad] == 0).all()
        ref_pool = StatePool([layer], num_slots=1, max_tokens=4, device=device)
        if pad == L:
            for s, old in zip(_states(pool), before):
                assert (s[:, int(slots[b])] == 0).all()
            continue
        md = RecoverSSMMetadata.build([L - pad], [True], [0], [0], num_slots=1, device=device)
        with torch.no_grad():
            ref = layer(hidden[b, pad:], md, ref_pool)
        assert rel_err(out[b, pad:], ref) < tol, b
        for s, r in zip(_states(pool), _states(ref_pool)):
            assert rel_err(s[:, int(slots[b])], r[:, 0]) < tol, b
    untouched = [0, 2, 4, 7]
    for s, old in zip(_states(pool), before):
        assert same_bits(s[:, untouched], old[:, untouched])


def test_malformed_inputs_are_refused_before_anything_is_written(device):
    layer = _layer("qwen3_5", (8, 6), device, False)
    pool = StatePool([layer], num_slots=2, max_tokens=4, device=device)
    for s in _states(pool):
        s.normal_()
    before = [s.clone() for s in _states(pool)]
    hidden = torch.randn(2, 5, 32, device=device)
    ok = torch.ones(2, 5, dtype=torch.bool, device=device)
    slots = torch.tensor([0, 1], device=device)
    with torch.no_grad():
        with pytest.raises(ValueError, match="valid has shape"):
            layer.prefill_padded(hidden, ok[:, :4], pool, slots)
        with pytest.raises(ValueError, match="valid has shape .* dtype torch.int64"):
            layer.prefill_padded(hidden, ok.long(), pool, slots)
        with pytest.raises(ValueError, match="slots has shape"):
            layer.prefill_padded(hidden, ok, pool, slots[:1])
    with pytest.raises(ValueError, match="grad mode"):
        layer.prefill_padded(hidden.requires_grad_(), ok, pool, slots)
    for s, old in zip(_states(pool), before):
        assert same_bits(s, old)
