"""Short-conv verify / commit against the token-by-token reference (CPU and CUDA)."""

import pytest
import torch

from ssm_spec import ops, reference
from tests.helpers import i32, qsl_from_lengths, rel_err, rotating_counts, same_bits


def _setup(device, C, ks, dil, lengths, srcs, S=12, dtype=torch.float32, state_dtype=None, seed=0,
           bias=True):
    gen = torch.Generator().manual_seed(seed)
    lc = (ks - 1) * dil
    qsl = qsl_from_lengths(lengths, device)
    T = int(qsl[-1]) + 1
    # x is a strided view (every other column of a wider buffer), as in a fused projection
    x = torch.randn(T, 2 * C, generator=gen).to(device=device, dtype=dtype)[:, ::2]
    weight = torch.randn(C, ks, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(C, generator=gen).to(device=device, dtype=dtype) if bias else None
    state = torch.randn(S, lc, C, generator=gen).to(device=device, dtype=state_dtype or dtype)
    return x, weight, b, state, qsl, i32(srcs, device)


@pytest.mark.parametrize("ks", [2, 3, 4])
@pytest.mark.parametrize("dil", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", ["silu", "none"])
def test_verify_matches_reference(device, ks, dil, activation):
    # windows shorter and longer than the state (Lc = (ks-1)*dil ranges 1..12), one empty,
    # a padding row, slot 0 used by a real row
    lengths, srcs = [2, 0, 7, 3, 1], [0, 4, 5, -1, 9]
    x, w, b, state, qsl, src = _setup(device, 40, ks, dil, lengths, srcs, bias=dil % 2 == 0)
    before = state.clone()
    out, rec_x = ops.short_conv_verify(x, w, b, state, src, qsl, dilation=dil, activation=activation)
    assert torch.equal(state, before), "verify wrote the conv state"
    for row, s in enumerate(srcs):
        bos, eos = int(qsl[row]), int(qsl[row + 1])
        if s < 0 or bos == eos:
            continue
        ref = reference.short_conv_native_step(x[bos:eos], w, b, state[s], dil, activation,
                                               dtype=torch.float64)
        assert rel_err(out[bos:eos], ref.out) < 1e-6
        assert torch.equal(rec_x[bos:eos], x[bos:eos].float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_low_precision(device, dtype):
    lengths, srcs = [4, 3], [1, 2]
    x, w, b, state, qsl, src = _setup(device, 24, 4, 2, lengths, srcs, dtype=dtype)
    out, rec_x = ops.short_conv_verify(x, w, b, state, src, qsl, dilation=2)
    assert out.dtype == dtype and rec_x.dtype == torch.float32
    for row, s in enumerate(srcs):
        bos, eos = int(qsl[row]), int(qsl[row + 1])
        ref = reference.short_conv_native_step(x[bos:eos], w, b, state[s], 2, dtype=torch.float64)
        assert rel_err(out[bos:eos], ref.out) < 1e-2


@pytest.mark.parametrize("ks,dil", [(2, 1), (4, 1), (3, 2), (4, 3), (2, 4)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_commit_every_count_and_in_place_shift(device, ks, dil, state_dtype):
    W = 5
    lengths, srcs = [W, W, 4, W], [0, 3, 6, -1]
    x, w, b, state, qsl, src = _setup(device, 33, ks, dil, lengths, srcs, state_dtype=state_dtype,
                                      dtype=torch.float32 if state_dtype == torch.float32 else torch.bfloat16)
    _, rec_x = ops.short_conv_verify(x, w, b, state, src, qsl, dilation=dil)
    for trial in range(W + 1):
        counts = rotating_counts(trial, lengths, W)
        work = state.clone()  # dst == src: an in-place shift whose ranges overlap
        ops.short_conv_commit(work, rec_x, qsl, src, i32(counts, device))
        for row, s in enumerate(srcs):
            if s < 0:
                continue
            n = counts[row]
            if n == 0:
                assert same_bits(work[s], state[s])
                continue
            bos = int(qsl[row])
            ref = reference.short_conv_native_step(x[bos:bos + n], w, b, state[s], dil,
                                                   dtype=torch.float64).states[-1]
            assert torch.equal(work[s], ref.to(state_dtype)), (row, n)
        others = [i for i in range(state.shape[0]) if i not in srcs]
        assert same_bits(work[others], state[others])


def test_commit_boundaries_dst_and_grouped(device):
    W, ks, dil, NL = 4, 4, 2, 3
    lengths, srcs = [W, 3, W], [1, 0, 2]
    layers = [_setup(device, 16, ks, dil, lengths, srcs, S=20, seed=s) for s in range(NL)]
    qsl, src = layers[0][4], layers[0][5]
    recs = [ops.short_conv_verify(x, w, b, st, src, qsl, dilation=dil)[1] for x, w, b, st, _, _ in layers]
    counts = i32([3, 3, 0], device)
    dst = i32([10, 11, 12], device)
    bidx = i32([[13, 14, 15], [16, -1, 17], [18, 19, 5]], device)
    boff = i32([[1, 3, 4], [2, 1, 0], [1, 2, 3]], device)
    grouped = torch.stack([layer[3] for layer in layers])
    grouped[:, 10:] = float("nan")
    before = grouped.clone()
    ops.short_conv_commit(grouped, torch.stack(recs), qsl, src, counts, dst, bidx, boff)
    written = {10, 11, 13, 14, 16}
    for layer, (x, w, b, st, _, _) in enumerate(layers):
        single = before[layer].clone()
        ops.short_conv_commit(single, recs[layer], qsl, src, counts, dst, bidx, boff)
        assert same_bits(grouped[layer], single)
        hist = {row: torch.cat([before[layer, srcs[row]], x[int(qsl[row]):int(qsl[row + 1])]])
                for row in range(3)}
        lc = (ks - 1) * dil
        assert torch.equal(grouped[layer, 10], hist[0][3:3 + lc])
        assert torch.equal(grouped[layer, 13], hist[0][1:1 + lc])
        assert torch.equal(grouped[layer, 14], hist[0][3:3 + lc])
        assert torch.equal(grouped[layer, 16], hist[1][2:2 + lc])
        for slot in range(20):
            if slot not in written:
                assert same_bits(grouped[layer, slot], before[layer, slot]), slot


def test_noncontiguous_indices_and_counts(device):
    """Slots, windows and counts as strided columns of 2-D tables (as engines keep them)."""
    W, ks, dil = 4, 3, 2
    lengths, srcs = [W, 2, W], [4, 0, 7]
    x, w, b, state, qsl, src = _setup(device, 10, ks, dil, lengths, srcs)
    table = torch.stack([src, src + 1], 1)[:, 0]
    qsl_s = torch.stack([qsl, qsl], 1)[:, 0]
    counts = i32([[3, 0], [2, 0], [0, 0]], device)[:, 0]
    assert not (table.is_contiguous() or qsl_s.is_contiguous() or counts.is_contiguous())
    out, rec_x = ops.short_conv_verify(x, w, b, state, table, qsl_s, dilation=dil)
    ref_out, ref_rec = ops.short_conv_verify(x, w, b, state, src, qsl, dilation=dil)
    assert torch.equal(out[: int(qsl[-1])], ref_out[: int(qsl[-1])])
    got, want = state.clone(), state.clone()
    ops.short_conv_commit(got, rec_x, qsl_s, table, counts)
    ops.short_conv_commit(want, ref_rec, qsl, src, counts.contiguous())
    assert same_bits(got, want)
