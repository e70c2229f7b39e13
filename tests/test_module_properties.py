"""Property-based check of a module stack's verify + commit against plain prefill (hypothesis).

Draws rows (history length, window, accepted count, padding), align settings and a dilation;
the step's outputs and every committed state must equal those of a fresh prefill over the
same tokens.
"""

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit
from tests.helpers import i32, rel_err

HIDDEN = 8


@functools.cache
def _stack(dilation):
    torch.manual_seed(dilation)
    layers = [RecoverGatedDeltaNet(HIDDEN, 1, 2, 4, 4, conv_kernel_size=3, layout="qwen3_next"),
              RecoverShortConv(HIDDEN, 3, dilation=dilation, bias=True),
              RecoverGatedDeltaNet(HIDDEN, 2, 2, 4, 3, layout="qwen3_5")]
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.normal_(std=0.4)
            if hasattr(layer, "A_log"):
                layer.A_log.uniform_(-1, 1)
    return layers


def _run(layers, x, md, pool):
    with torch.no_grad():
        for layer in layers:
            x = x + layer(x, md, pool)
    return x


def _states(pool, slot):
    return [s[:, slot] for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())]


def _fresh(layers, x):
    """Outputs of a fresh prefill over ``x`` and the states after it."""
    pool = StatePool(layers, num_slots=1, max_tokens=max(len(x), 1))
    md = RecoverSSMMetadata.build([len(x)], [True], [0], [0])
    return _run(layers, x, md, pool), _states(pool, 0)


@st.composite
def steps(draw):
    B = draw(st.integers(1, 4))
    rows = []
    for _ in range(B):
        if draw(st.integers(0, 5)) == 0:
            rows.append(None)  # a padding row
            continue
        nc = draw(st.integers(0, 7))
        length = draw(st.integers(1, 5))
        rows.append((nc, length, draw(st.integers(0, length))))
    align = draw(st.booleans())
    block_size = draw(st.integers(1, 4)) if align else None
    return rows, block_size, draw(st.integers(1, 3)), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_stack_verify_commit_equals_fresh_prefill(step):
    rows, block_size, dilation, seed = step
    layers = _stack(dilation)
    gen = torch.Generator().manual_seed(seed)
    B = len(rows)
    hist = [torch.randn(r[0] + r[1], HIDDEN, generator=gen) if r else None for r in rows]
    ncols = 16
    S = B * ncols + 1 if block_size else B + 1
    # row b owns slots b * ncols + 1 ... (align) or slot b + 1; padding rows own nothing
    table = [[b * ncols + 1 + c for c in range(ncols)] if r else [-1] * ncols for b, r in enumerate(rows)]
    slots = [b + 1 if r else -1 for b, r in enumerate(rows)]
    where = dict(block_size=block_size, block_table=table) if block_size else {}
    pool = StatePool(layers, num_slots=S, max_tokens=64)

    def build(lens, prefill, nct):
        if block_size:
            return RecoverSSMMetadata.build(lens, prefill, nct, num_slots=S, **where)
        return RecoverSSMMetadata.build(lens, prefill, nct, slots, num_slots=S)

    # 1. the history as prefill rows (rows without history skip: zero-length prefill)
    lens = [r[0] if r else 0 for r in rows]
    md = build(lens, [True] * B, [0] * B)
    if sum(lens):
        _run(layers, torch.cat([h[: r[0]] for h, r in zip(hist, rows) if r]), md, pool)
    # 2. one verify step over every row's window, then commit
    lens = [r[1] if r else 0 for r in rows]
    md = build(lens, [False] * B, [r[0] if r else 0 for r in rows])
    out = _run(layers, torch.cat([h[r[0]:] for h, r in zip(hist, rows) if r] or [torch.empty(0, HIDDEN)]), md, pool)
    commit(pool, md, i32([r[2] if r else 0 for r in rows], "cpu"))
    at = 0
    for b, r in enumerate(rows):
        if not r:
            continue
        nc, length, n = r
        ref_out, _ = _fresh(layers, hist[b])
        assert rel_err(out[at:at + length], ref_out[nc:]) < 1e-4
        at += length
        done = nc + n
        if done == 0:
            continue
        _, ref_states = _fresh(layers, hist[b][:done])
        slot = table[b][(done - 1) // block_size] if block_size else slots[b]
        for got, want in zip(_states(pool, slot), ref_states):
            assert rel_err(got, want) < 1e-4, (b, r, block_size)
        if block_size:  # blocks past the last accepted token's block are never written
            for col in range((done - 1) // block_size + 1, ncols):
                assert all(not s.any() for s in _states(pool, table[b][col])), (b, r, col)
