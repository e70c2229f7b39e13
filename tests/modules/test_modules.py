"""Modules, pool, metadata and the step commit (CPU; the same files run on CUDA)."""

import inspect

import pytest
import torch
import transformers  # the dev extra installs it: a missing one must fail, not skip

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit
from tests.helpers import FLA_PREFILL_TOL, i32, prefill_uses_fla, randomize_, rel_err, run_stack, same_bits


def _hf_layer(layout, seed=0, head_dims=(8, 6)):
    torch.manual_seed(seed)
    common = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head_dims[0],
                  linear_value_head_dim=head_dims[1], linear_conv_kernel_dim=4, num_hidden_layers=1,
                  layer_types=["linear_attention"])
    if layout == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        hf = Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**common), 0)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        cfg = transformers.Qwen3_5TextConfig(**common)
        hf = Qwen3_5GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.3)
        hf.A_log.uniform_(-1, 1)
    return hf.eval()


def _hf_cache_kwarg(hf) -> str:
    """transformers 5.2x names the GDN layer's cache argument ``cache``; 5.17 ``cache_params``
    (an unknown keyword would be swallowed by ``**kwargs`` and the layer run without a cache)."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "cache_params"


def _decode(layer, pool, x, prompt, steps, device, slot=1):
    """Prefill ``prompt`` tokens, then decode one token per step (verify + commit n=1)."""
    S = pool.num_slots
    md = RecoverSSMMetadata.build([prompt], [True], [0], [slot], num_slots=S, device=device)
    outs = [layer(x[:prompt], md, pool)]
    for t in range(steps):
        md = RecoverSSMMetadata.build([1], [False], [prompt + t], [slot], num_slots=S, device=device)
        outs.append(layer(x[prompt + t : prompt + t + 1], md, pool))
        commit(pool, md, i32([1], device))
    return torch.cat(outs)


@pytest.mark.parametrize("head_dims", [(8, 6), (16, 32)])  # (16, 32): fla-core's chunked prefill on CUDA
@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_from_hf_prefill_and_32_decode_steps_match_hf(device, layout, head_dims):
    hf = _hf_layer(layout, head_dims=head_dims).to(device)
    layer = RecoverGatedDeltaNet.from_hf(hf)
    assert layer.layout == layout and layer.out_proj is hf.out_proj  # shared weights
    x = torch.randn(1, 12 + 32, 32, device=device)
    with torch.no_grad():
        ref = hf(x)[0]
        pool = StatePool([layer], num_slots=3, max_tokens=16, device=device)
        got = _decode(layer, pool, x[0], 12, 32, device)
    assert rel_err(got, ref) < (FLA_PREFILL_TOL if prefill_uses_fla(device, head_dims) else 1e-5)




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_prefill_runs_through_fla(monkeypatch):
    """With the `cuda` extra installed, prompt rows on CUDA go through fla-core's chunked
    prefill (head dims >= 16): a first chunk from the zero state, then a continuation chunk in
    align mode whose boundaries split it (fla starting from non-zero states). Outputs and every
    state written equal the reference's token loop (fla disabled) within FLA_PREFILL_TOL."""
    pytest.importorskip("fla", reason="fla-core (the cuda extra) is not installed")
    from ssm_spec.modules import prefill

    chunk = prefill._fla_chunk()
    assert chunk is not None
    hf = _hf_layer("qwen3_next", head_dims=(16, 32)).cuda()
    layer = RecoverGatedDeltaNet.from_hf(hf)
    x = torch.randn(70, 32, device="cuda")
    table = [[5, 2, 7, 0, 3, 1, 6, 4, 8]]  # block_size 8: 70 tokens fill 9 blocks
    runs = []
    for fla in (True, False):  # fla-core's chunks, then the reference's token loop
        calls = []
        monkeypatch.setattr(prefill, "_fla_chunk",
                            lambda: (lambda *a, **k: calls.append(1) or chunk(*a, **k)) if fla else None)
        pool = StatePool([layer], num_slots=9, max_tokens=8, device="cuda")
        outs = []
        with torch.no_grad():
            for lo, hi in ((0, 19), (19, 70)):
                md = RecoverSSMMetadata.build([hi - lo], [True], [lo], block_size=8, block_table=table,
                                              num_slots=9, device="cuda")
                outs.append(layer(x[lo:hi], md, pool))
        (state, _), = pool.gdn_groups.values()
        (conv, _), = pool.conv_groups.values()
        runs.append((torch.cat(outs), state.clone(), conv.clone(), len(calls)))
    (out, state, conv, n_fla), (ref_out, ref_state, ref_conv, n_ref) = runs
    assert n_fla >= 2 and n_ref == 0, "fla-core's chunk_gated_delta_rule was not called"
    assert rel_err(out, ref_out) < FLA_PREFILL_TOL
    for col in table[0]:
        assert ref_state[:, col].abs().sum() > 0
        assert rel_err(state[:, col], ref_state[:, col]) < FLA_PREFILL_TOL, col
        assert torch.equal(conv[:, col], ref_conv[:, col])


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_state_dict_loads_directly(layout):
    hf = _hf_layer(layout)
    fresh = RecoverGatedDeltaNet(32, 2, 4, 8, 6, layout=layout)
    fresh.load_state_dict(hf.state_dict())
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        pool = StatePool([fresh], num_slots=2, max_tokens=16)
        md = RecoverSSMMetadata.build([9], [True], [0], [0], num_slots=2)
        assert rel_err(fresh(x[0], md, pool), hf(x)[0]) < 1e-5


def test_speculative_windows_with_random_acceptance_match_hf(device):
    """Verify windows of W tokens whose drafts may be wrong; commit a random prefix; the kept
    outputs equal Hugging Face's on the accepted sequence (0, 1 and W accepted included)."""
    hf = _hf_layer("qwen3_next", seed=1).to(device)
    layer = RecoverGatedDeltaNet.from_hf(hf)
    W, steps = 4, 24
    gen = torch.Generator().manual_seed(5)
    pool = StatePool([layer], num_slots=2, max_tokens=16, device=device)
    prompt = torch.randn(7, 32, generator=gen).to(device)
    accepted = [prompt]
    kept = []
    with torch.no_grad():
        md = RecoverSSMMetadata.build([7], [True], [0], [0], num_slots=2, device=device)
        kept.append(layer(prompt, md, pool))
        done = 7
        for step in range(steps):
            window = torch.randn(W, 32, generator=gen).to(device)
            n = [0, 1, W, 2][step % 4] if step < 4 else int(torch.randint(0, W + 1, (1,), generator=gen))
            md = RecoverSSMMetadata.build([W], [False], [done], [0], num_slots=2, device=device)
            out = layer(window, md, pool)
            commit(pool, md, i32([n], device))
            kept.append(out[:n])
            accepted.append(window[:n])
            done += n
        ref = hf(torch.cat(accepted)[None])[0]
    assert rel_err(torch.cat(kept), ref) < 1e-5


def _stack(seed=0):
    torch.manual_seed(seed)
    layers = [RecoverGatedDeltaNet(16, 2, 4, 8, 4, layout="qwen3_next"), RecoverShortConv(16, 3, dilation=2, bias=True),
              RecoverGatedDeltaNet(16, 1, 2, 8, 8, layout="qwen3_5")]
    return randomize_(layers, 0.3)


_run = run_stack


def test_mixed_batch_any_order_equals_unpermuted(device):
    """Prefill and verify rows in any order (a 1-token row between verifying rows, a final
    prefill chunk of length 1): every row's outputs and states do not depend on the order."""
    layers = [m.to(device) for m in _stack()]
    gen = torch.Generator().manual_seed(2)
    rows = [  # (tokens, is_prefill, num_computed, slot)
        (5, True, 0, 0), (1, False, 3, 1), (4, False, 6, 2), (1, True, 9, 3), (3, False, 2, 4)]
    x = {i: torch.randn(r[0], 16, generator=gen).to(device) for i, r in enumerate(rows)}

    def run(order):
        pool = StatePool(layers, num_slots=6, max_tokens=32, device=device)
        g2 = torch.Generator().manual_seed(9)
        for state, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values()):
            state.copy_(torch.randn(state.shape, generator=g2).to(device) * 0.3)
        md = RecoverSSMMetadata.build([rows[i][0] for i in order], [rows[i][1] for i in order],
                                      [rows[i][2] for i in order], [rows[i][3] for i in order],
                                      num_slots=6, device=device)
        with torch.no_grad():
            out = _run(layers, torch.cat([x[i] for i in order]), md, pool)
            commit(pool, md, i32([min(2, rows[i][0]) for i in order], device))
        split = dict(zip(order, torch.split(out, [rows[i][0] for i in order])))
        return split, pool

    a, pool_a = run([0, 1, 2, 3, 4])
    b, pool_b = run([2, 0, 4, 3, 1])
    for i in range(len(rows)):
        assert rel_err(a[i], b[i]) < 1e-6
    for (sa, _), (sb, _) in zip((*pool_a.gdn_groups.values(), *pool_a.conv_groups.values()),
                                (*pool_b.gdn_groups.values(), *pool_b.conv_groups.values())):
        assert rel_err(sa, sb) < 1e-6


def test_discarded_step_and_padding_rows_touch_nothing(device):
    layers = [m.to(device) for m in _stack(3)]
    pool = StatePool(layers, num_slots=8, max_tokens=32, device=device)
    for state, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values()):
        state.normal_()
    before = [s.clone() for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())]
    # a batch of 5 rows padded to 8; slot 0 is a real row's slot
    md = RecoverSSMMetadata.build([4] * 5 + [0] * 3, [False] * 8, [7] * 8, [0, 2, 4, 5, 6, -1, -1, -1],
                                  num_slots=8, device=device)
    with torch.no_grad():
        _run(layers, torch.randn(20, 16, device=device), md, pool)
    commit(pool, md, i32([0] * 8, device))  # every row discards its step
    for s, b in zip((s for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())), before):
        assert same_bits(s, b)
    commit(pool, md, i32([1, 0, 4, 0, 2, 0, 0, 0], device))
    for s, b in zip((s for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())), before):
        assert same_bits(s[:, [1, 2, 3, 5, 7]], b[:, [1, 2, 3, 5, 7]])  # n = 0 rows and unused slots
        assert not any(same_bits(s[:, i], b[:, i]) for i in (0, 4, 6))


def test_commit_uses_the_metadata_slots_even_if_the_caller_mutates_its_tensors(device):
    layers = [m.to(device) for m in _stack(4)]
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=device)
    slots = i32([1, 2], device)
    md = RecoverSSMMetadata.build([3, 3], [False, False], [5, 5], slots, num_slots=4, device=device)
    with torch.no_grad():
        _run(layers, torch.randn(6, 16, device=device), md, pool)
    slots.fill_(3)
    commit(pool, md, i32([2, 3], device))
    for state, _ in pool.gdn_groups.values():
        assert state[:, 3].abs().sum() == 0 and state[:, 1].abs().sum() > 0


def test_metadata_rejects_malformed_steps():
    build = RecoverSSMMetadata.build
    with pytest.raises(ValueError, match="state_indices"):
        build([2, 2], [False, False], [1, 1], [3, 3])  # two rows, one slot
    with pytest.raises(ValueError, match="state_indices"):
        build([2], [False], [1], [-1])  # padding row with tokens
    with pytest.raises(ValueError, match="state_indices"):
        build([2], [False], [1], [9], num_slots=4)
    with pytest.raises(ValueError, match="block_table"):
        build([4], [False], [6], block_size=4, block_table=[[1, -1]])  # column 1 is null
    with pytest.raises(ValueError, match="2 columns"):
        build([4], [False], [6], block_size=4, block_table=[[1, 2]])  # the window may reach column 2
    with pytest.raises(ValueError, match="distinct"):
        build([4], [False], [2], block_size=2, block_table=[[1, 3, 3, 4]])  # one slot, two blocks
    with pytest.raises(ValueError, match="checkpoint"):  # row 1 would write row 0's checkpoint
        build([2, 2], [False, False], [4, 3], block_size=4, block_table=[[5, 6], [7, 5]])
    # rows may share a read-only checkpoint block (a cached prefix); an empty row at a full
    # table reads and writes nothing
    md = build([5, 3, 0], [True, False, False], [4, 4, 8], block_size=4,
               block_table=[[1, 2, 3], [1, 5, 6], [7, 8, -1]])
    assert md.verify_indices.tolist() == [-1, 1, 8] and md.fresh_slots.numel() == 0
    with pytest.raises(ValueError, match="num_computed_tokens"):
        build([1], [False], [1, 2], [0])


# ----------------------------------------------------------------------------- align mode


def _align_run(device, block_size, nc, W, n, ncols=12):
    """One GDN + conv stack: a verify window of W tokens at ``nc`` committed tokens, commit n;
    compare every written block with the state after that many tokens (reference chain)."""
    layers = [m.to(device) for m in _stack(6)]
    S = ncols + 1
    gen = torch.Generator().manual_seed(nc * 31 + n)
    pool = StatePool(layers, num_slots=S, max_tokens=32, device=device)
    x = torch.randn(nc + W, 16, generator=gen).to(device)
    table = [list(range(1, ncols + 1))]
    with torch.no_grad():
        # prefill nc tokens in align mode (boundary states written), then verify the window
        md = RecoverSSMMetadata.build([nc], [True], [0], block_size=block_size, block_table=table,
                                      num_slots=S, device=device)
        _run(layers, x[:nc], md, pool)
        md = RecoverSSMMetadata.build([W], [False], [nc], block_size=block_size, block_table=table,
                                      num_slots=S, device=device)
        _run(layers, x[nc:], md, pool)
        commit(pool, md, i32([n], device))
        # reference: a plain (non-align) pool prefilled with every length
        for length in range(1, nc + n + 1):
            if length % block_size and length != nc + n:
                continue
            ref_pool = StatePool(layers, num_slots=1, max_tokens=64, device=device)
            _run(layers, x[:length], RecoverSSMMetadata.build([length], [True], [0], [0], device=device), ref_pool)
            col = (length - 1) // block_size
            for (s, _), (r, _) in zip((*pool.gdn_groups.values(), *pool.conv_groups.values()),
                                      (*ref_pool.gdn_groups.values(), *ref_pool.conv_groups.values())):
                assert rel_err(s[:, table[0][col]], r[:, 0]) < 1e-5, (length, col)


@pytest.mark.parametrize("block_size,nc,W,n", [
    (4, 8, 4, 4),   # window ends exactly on a boundary
    (4, 6, 4, 3),   # crosses one boundary
    (1, 5, 4, 4),   # block_size 1: a boundary after every token
    (2, 5, 5, 5),   # several boundaries in one window
    (8, 2, 4, 2),   # checkpoint and final state in one block
    (4, 6, 4, 0),   # nothing accepted
    (3, 2, 5, 5),   # a boundary strictly inside, then the final block (W % block_size >= 2)
])
def test_align_mode_blocks(device, block_size, nc, W, n):
    _align_run(device, block_size, nc, W, n)


def test_recoverssm_and_snapshot_modes_decode_the_same(device):
    """The native per-draft protocol (StatePool(snapshot=True)) and RecoverSSM, on one stack,
    over 40 steps of two rows with random windows and acceptance (0, 1 and W included)."""
    layers = [m.to(device) for m in _stack(8)]
    W = 4
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randn(6, 16, generator=gen).to(device), torch.randn(3, 16, generator=gen).to(device)]
    windows = [torch.randn(2 * W, 16, generator=gen).to(device) for _ in range(40)]
    counts = [[0, W], [1, 0], [W, 1]] + [torch.randint(0, W + 1, (2,), generator=gen).tolist() for _ in range(37)]
    results = []
    for snapshot in (False, True):
        pool = StatePool(layers, num_slots=4, max_tokens=16, device=device, snapshot=snapshot)
        outs = []
        with torch.no_grad():
            md = RecoverSSMMetadata.build([6, 3], [True, True], [0, 0], [1, 3], num_slots=4, device=device)
            outs.append(_run(layers, torch.cat(prompts), md, pool))
            done = [6, 3]
            for step in range(40):
                md = RecoverSSMMetadata.build([W, W], [False, False], done, [1, 3], num_slots=4, device=device)
                outs.append(_run(layers, windows[step], md, pool))
                commit(pool, md, i32(counts[step], device))
                done = [d + n for d, n in zip(done, counts[step])]
        results.append((torch.cat(outs), [s[:, [1, 3]].clone() for s, _ in
                                          (*pool.gdn_groups.values(), *pool.conv_groups.values())]))
    (out_r, states_r), (out_s, states_s) = results
    assert rel_err(out_s, out_r) < 1e-6
    for a, b in zip(states_r, states_s):
        if device.type == "cpu":  # the same backend's snapshot and commit: bit for bit
            assert torch.equal(a, b)
        assert rel_err(a, b) < 1e-6


def test_ragged_windows_strided_slots_and_a_plain_decode_after_drafts(device):
    """Windows of 2, 4 and 3 tokens (k = 3) in one batch, slots given as a strided column of a
    2-D table; then a step without drafts (one token) reads the committed state."""
    layers = [m.to(device) for m in _stack(10)]
    gen = torch.Generator().manual_seed(4)
    hist = [torch.randn(20, 16, generator=gen).to(device) for _ in range(3)]
    table = i32([[2, 7], [0, 7], [5, 7]], device)
    slots = table[:, 0]
    assert not slots.is_contiguous()
    pool = StatePool(layers, num_slots=6, max_tokens=32, device=device)
    with torch.no_grad():
        md = RecoverSSMMetadata.build([5, 5, 5], [True] * 3, [0] * 3, slots, num_slots=6, device=device)
        _run(layers, torch.cat([h[:5] for h in hist]), md, pool)
        md = RecoverSSMMetadata.build([2, 4, 3], [False] * 3, [5] * 3, slots, num_slots=6, device=device)
        _run(layers, torch.cat([hist[0][5:7], hist[1][5:9], hist[2][5:8]]), md, pool)
        counts = [2, 4, 1]
        commit(pool, md, i32(counts, device))
        md = RecoverSSMMetadata.build([1] * 3, [False] * 3, [5 + n for n in counts], slots, num_slots=6,
                                      device=device)
        out = _run(layers, torch.cat([h[5 + n:6 + n] for h, n in zip(hist, counts)]), md, pool)
        commit(pool, md, i32([1, 1, 1], device))
        for b, n in enumerate(counts):
            ref_pool = StatePool(layers, num_slots=1, max_tokens=32, device=device)
            ref = _run(layers, hist[b][:6 + n], RecoverSSMMetadata.build([6 + n], [True], [0], [0], device=device),
                       ref_pool)
            assert rel_err(out[b], ref[-1]) < 1e-5
            slot = int(table[b, 0])
            for (s, _), (r, _) in zip((*pool.gdn_groups.values(), *pool.conv_groups.values()),
                                      (*ref_pool.gdn_groups.values(), *ref_pool.conv_groups.values())):
                assert rel_err(s[:, slot], r[:, 0]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_commit_is_one_launch_per_group():
    """Three GDN layers of one shape and two conv shapes: three commit kernels in all."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = [RecoverGatedDeltaNet(16, 2, 4, 8, 4).to(device) for _ in range(3)]
    layers.append(RecoverShortConv(16, 3, dilation=2).to(device))
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=device)
    md = RecoverSSMMetadata.build([4, 4], [False, False], [3, 3], [0, 2], num_slots=4, device=device)
    with torch.no_grad():
        _run(layers, torch.randn(8, 16, device=device), md, pool)
    n = i32([2, 4], device)
    commit(pool, md, n)  # warm up (compiles the kernels)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        commit(pool, md, n, validate=False)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("gdn_commit_kernel" in x for x in names) == 1
    assert sum("short_conv_commit_kernel" in x for x in names) == 2  # GDN's qkv conv + the PLE conv


def test_stack_decodes_256_tokens_with_random_acceptance(device):
    """256 accepted tokens, a random count every step (0, 1 and W included): the outputs of
    accepted tokens and the final states equal one prefill over the accepted sequence."""
    layers = [m.to(device) for m in _stack(12)]
    W = 4
    gen = torch.Generator().manual_seed(21)
    pool = StatePool(layers, num_slots=2, max_tokens=16, device=device)
    accepted, kept, done = [], [], 0
    with torch.no_grad():
        while done < 256:
            window = torch.randn(W, 16, generator=gen).to(device)
            n = min(int(torch.randint(0, W + 1, (1,), generator=gen)), 256 - done)
            md = RecoverSSMMetadata.build([W], [False], [done], [1], num_slots=2, device=device)
            out = _run(layers, window, md, pool)
            commit(pool, md, i32([n], device))
            kept.append(out[:n])
            accepted.append(window[:n])
            done += n
        ref_pool = StatePool(layers, num_slots=1, max_tokens=256, device=device)
        ref = _run(layers, torch.cat(accepted), RecoverSSMMetadata.build([256], [True], [0], [0], device=device),
                   ref_pool)
    assert rel_err(torch.cat(kept), ref) < 1e-5
    for (s, _), (r, _) in zip((*pool.gdn_groups.values(), *pool.conv_groups.values()),
                              (*ref_pool.gdn_groups.values(), *ref_pool.conv_groups.values())):
        assert rel_err(s[:, 1], r[:, 0]) < 1e-5


def test_step_buffers_longer_than_the_step_and_pool_checks(device):
    layers = [m.to(device) for m in _stack(14)]
    pool = StatePool(layers, num_slots=4, max_tokens=16, device=device)
    x = torch.randn(8, 16, device=device)
    md = RecoverSSMMetadata.build([3, 2], [False, True], [5, 0], [1, 2], num_slots=4, device=device)
    with torch.no_grad():
        padded = _run(layers, x, md, pool)  # 8 token rows for a 5-token step
    pool2 = StatePool(layers, num_slots=4, max_tokens=16, device=device)
    with torch.no_grad():
        exact = _run(layers, x[:5], md, pool2)
    assert rel_err(padded[:5], exact) < 1e-6 and torch.equal(padded[5:], x[5:])  # zero layer outputs
    big = RecoverSSMMetadata.build([2], [True], [0], [99], device=device)  # no num_slots given
    before = [s.clone() for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())]
    with pytest.raises(ValueError, match="slot 99"):
        _run(layers, x[:2], big, pool)
    assert all(torch.equal(s, b) for (s, _), b in zip((*pool.gdn_groups.values(), *pool.conv_groups.values()),
                                                        before))


def test_fresh_verify_row_in_align_mode_starts_from_zero_on_a_dirty_block(device):
    layers = [m.to(device) for m in _stack(15)]
    pool = StatePool(layers, num_slots=6, max_tokens=16, device=device)
    for state, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values()):
        state.normal_()  # a recycled block
    x = torch.randn(3, 16, device=device)
    md = RecoverSSMMetadata.build([3], [False], [0], block_size=2, block_table=[[4, 5]], num_slots=6,
                                  device=device)
    ref_pool = StatePool(layers, num_slots=1, max_tokens=16, device=device)
    with torch.no_grad():
        out = _run(layers, x, md, pool)
        commit(pool, md, i32([3], device))
        ref = _run(layers, x, RecoverSSMMetadata.build([3], [True], [0], [0], device=device), ref_pool)
    assert rel_err(out, ref) < 1e-5
    for (s, _), (r, _) in zip((*pool.gdn_groups.values(), *pool.conv_groups.values()),
                              (*ref_pool.gdn_groups.values(), *ref_pool.conv_groups.values())):
        assert rel_err(s[:, 5], r[:, 0]) < 1e-5


def test_pool_never_joins_autograd_and_from_hf_rejects_other_activations():
    layers = _stack(16)
    pool = StatePool(layers, num_slots=2, max_tokens=16)
    md = RecoverSSMMetadata.build([4], [True], [0], [1], num_slots=2)
    with pytest.raises(ValueError, match="grad"):  # grad mode on, parameters require grad
        layers[0](torch.randn(4, 16), md, pool)
    with torch.no_grad():
        run_stack(layers, torch.randn(4, 16), md, pool)
    assert not any(s.requires_grad for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values()))
    hf = _hf_layer("qwen3_next")
    hf.activation = "gelu"
    with pytest.raises(ValueError, match="activation"):
        RecoverGatedDeltaNet.from_hf(hf)


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_matches_hf_cached_decode_outputs_and_states(device, layout):
    """Prefill 12 tokens, then 32 one-token steps, against Hugging Face's own cached decode:
    outputs, and the final recurrent and conv states."""
    hf = _hf_layer(layout, seed=3).to(device)
    cfg = hf.config if hasattr(hf, "config") else None
    common = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                  layer_types=["linear_attention"])
    cfg = cfg or (transformers.Qwen3NextConfig(**common) if layout == "qwen3_next"
                  else transformers.Qwen3_5TextConfig(**common))
    cache = transformers.DynamicCache(config=cfg)
    x = torch.randn(1, 12 + 32, 32, device=device)
    layer = RecoverGatedDeltaNet.from_hf(hf)
    with torch.no_grad():
        kw = _hf_cache_kwarg(hf)
        ref = [hf(x[:, :12], **{kw: cache})]
        ref += [hf(x[:, t:t + 1], **{kw: cache}) for t in range(12, 44)]
        pool = StatePool([layer], num_slots=3, max_tokens=16, device=device)
        got = _decode(layer, pool, x[0], 12, 32, device)
    assert rel_err(got, torch.cat(ref, 1)[0]) < 1e-5
    hf_layer_cache = cache.layers[0]
    if not hasattr(hf_layer_cache, "recurrent_states"):  # older cache layouts: outputs only
        return
    recurrent, conv = hf_layer_cache.recurrent_states[0], hf_layer_cache.conv_states[0]
    assert rel_err(pool.gdn_state(layer)[1], recurrent[0]) < 1e-5
    assert torch.equal(pool.conv_state(layer)[1], conv[0, :, 1:].T.to(pool.conv_state(layer).dtype))


def test_records_cover_the_verify_span_only(device):
    """Verify rows first, then a 100-token prefill, with records for 16 tokens: the verify
    windows span 6 tokens, so the step fits, and it equals fresh prefills. Verify rows that
    enclose the prefill span it too: a clear ValueError, nothing written."""
    layers = [m.to(device) for m in _stack(17)]
    gen = torch.Generator().manual_seed(3)
    hist = [torch.randn(n, 16, generator=gen).to(device) for n in (8, 9, 100)]
    pool = StatePool(layers, num_slots=3, max_tokens=16, device=device)
    with torch.no_grad():
        md = RecoverSSMMetadata.build([5, 6], [True, True], [0, 0], [0, 1], num_slots=3, device=device)
        _run(layers, torch.cat([hist[0][:5], hist[1][:6]]), md, pool)
        enclosing = RecoverSSMMetadata.build([3, 100, 3], [False, True, False], [5, 0, 6], [0, 2, 1],
                                             num_slots=3, device=device)
        before = [s.clone() for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())]
        with pytest.raises(ValueError, match="span"):
            _run(layers, torch.cat([hist[0][5:8], hist[2], hist[1][6:9]]), enclosing, pool)
        assert all(torch.equal(s, b) for (s, _), b in
                   zip((*pool.gdn_groups.values(), *pool.conv_groups.values()), before))
        md = RecoverSSMMetadata.build([3, 3, 100], [False, False, True], [5, 6, 0], [0, 1, 2],
                                      num_slots=3, device=device)
        assert (md.verify_start, md.verify_stop) == (0, 6)
        out = _run(layers, torch.cat([hist[0][5:8], hist[1][6:9], hist[2]]), md, pool)
        commit(pool, md, i32([2, 3, 0], device))
        for b, (lo, n, slot) in enumerate([(5, 2, 0), (6, 3, 1)]):
            ref_pool = StatePool(layers, num_slots=1, max_tokens=16, device=device)
            ref = _run(layers, hist[b][:lo + 3], RecoverSSMMetadata.build([lo + 3], [True], [0], [0], device=device),
                       ref_pool)
            assert rel_err(out[3 * b:3 * b + 3], ref[lo:]) < 1e-5
            ref_pool = StatePool(layers, num_slots=1, max_tokens=16, device=device)
            _run(layers, hist[b][:lo + n], RecoverSSMMetadata.build([lo + n], [True], [0], [0], device=device), ref_pool)
            for (s, _), (r, _) in zip((*pool.gdn_groups.values(), *pool.conv_groups.values()),
                                      (*ref_pool.gdn_groups.values(), *ref_pool.conv_groups.values())):
                assert rel_err(s[:, slot], r[:, 0]) < 1e-5


def test_a_step_compiled_with_dynamic_shapes_writes_every_layers_states():
    """Two GDN layers sharing one pool group (the second one's state and record views start past
    the first's), verify + commit under ``torch.compile(dynamic=True)`` on pools of two sizes:
    every layer's states equal the eager step's. The pool's buffers are static to dynamo: with
    dynamic sizes inductor lowered a view's storage offset to 0 and the second layer's writes
    landed in the first's buffers."""
    torch.manual_seed(0)
    layers = randomize_([RecoverGatedDeltaNet(16, 2, 4, 8, 4, layout="qwen3_5") for _ in range(2)], 0.3)

    def step(x, md, pool, n):
        out = layers[1](layers[0](x, md, pool), md, pool)
        commit(pool, md, n, validate=False)
        return out

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for slots, W in ((2, 2), (5, 3)):
            pools = [StatePool(layers, num_slots=slots, max_tokens=slots * W) for _ in range(2)]
            for pool in pools:
                for group in pool._gdn.values():
                    group.state.copy_(torch.randn(group.state.shape, generator=torch.Generator().manual_seed(1)))
            md = RecoverSSMMetadata.build([W] * slots, [False] * slots, [5] * slots, list(range(slots)),
                                          num_slots=slots)
            x = torch.randn(slots * W, 16, generator=torch.Generator().manual_seed(2))
            n = i32([W - 1] * slots, "cpu")
            want = step(x, md, pools[0], n)
            got = compiled(x, md, pools[1], n)
            assert rel_err(got, want) < 1e-5
            for a, b in zip(pools[0]._gdn.values(), pools[1]._gdn.values()):
                assert rel_err(b.state, a.state) < 1e-6, (slots, W)


@pytest.mark.parametrize("kw", [{}, {"snapshot": True}, {"folded": True}, {"folded": True, "mode": "fast"}],
                         ids=["exact", "snapshot", "folded", "fast-folded"])
def test_a_dropped_pool_frees_its_buffers_at_once(kw):
    """A pool that stepped holds no reference cycle: dropping its last reference frees its state
    buffers then, not at a later garbage-collection pass (with large GPU states that is memory
    a new pool would otherwise have to find beside the old one)."""
    import weakref

    from ssm_spec.capture import collection_paused

    layers = [RecoverGatedDeltaNet(32, 2, 4, 8, 8), RecoverShortConv(32, 3)]
    randomize_(layers, 0.3)
    pool = StatePool(layers, num_slots=4, max_tokens=16, max_window=4, **kw)
    md = RecoverSSMMetadata.build([5, 3], [True] * 2, [0, 0], [0, 3], num_slots=4)
    run_stack(layers, torch.randn(8, 32), md, pool)
    view = pool.gdn_state(layers[0])  # a view of the pool's state buffer
    state, pool_ref = weakref.ref(view._base if view._base is not None else view), weakref.ref(pool)
    del view
    assert state() is not None
    with collection_paused():
        del pool
        assert pool_ref() is None and state() is None


def test_a_folded_pools_copy_commits_to_itself_and_a_pool_pickles():
    """The pending-window bookkeeping holds its pool weakly; a deep copy of a folded pool is tied
    to the copy (its commits fold into the copy's states, the original's stay), and a pool
    pickles and comes back working."""
    import copy
    import pickle

    layers = [RecoverGatedDeltaNet(32, 2, 4, 8, 8), RecoverShortConv(32, 3)]
    randomize_(layers, 0.3)
    pool = StatePool(layers, num_slots=4, max_tokens=16, max_window=4, folded=True)
    prefill = RecoverSSMMetadata.build([5, 3], [True] * 2, [0, 0], [0, 3], num_slots=4)
    run_stack(layers, torch.randn(8, 32), prefill, pool)
    commit(pool, prefill, i32([5, 3], "cpu"))
    for dup in (copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        assert dup.pending.pool is dup
        before = pool.gdn_state(layers[0]).clone()
        step = RecoverSSMMetadata.build([3, 2], [False] * 2, [5, 3], [0, 3], num_slots=4)
        run_stack(layers, torch.randn(5, 32), step, dup)
        commit(dup, step, i32([2, 1], "cpu"))
        dup.flush([0, 3])
        assert torch.equal(pool.gdn_state(layers[0]), before)
        assert not torch.equal(dup.gdn_state(layers[0]), before)
