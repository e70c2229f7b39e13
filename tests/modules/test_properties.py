"""Property-based check of a module stack's steps against plain prefill (hypothesis).

Draws rows (history, then in one mixed step either a prefill continuation chunk or a verify
window with an accepted count), padding rows, the row order, slots (slot 0 included), align
settings, head shapes and a dilation. The step's outputs, every committed final state and
every boundary block written must equal a fresh prefill over the same tokens, and no block
past the last one reached may be written.
"""

import functools

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit
from tests.helpers import i32, randomize_, rel_err, run_stack

HIDDEN = 8


@functools.cache
def _stack(dilation, heads):
    H, group, K, V = heads
    torch.manual_seed(dilation * 7 + K)
    layers = [RecoverGatedDeltaNet(HIDDEN, H, H * group, K, V, conv_kernel_size=3, layout="qwen3_next"),
              RecoverShortConv(HIDDEN, 3, dilation=dilation, bias=True),
              RecoverGatedDeltaNet(HIDDEN, 2, 2, 4, 3, layout="qwen3_5")]
    return randomize_(layers, 0.4)


_run = run_stack


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
        if draw(st.integers(0, 6)) == 0:
            rows.append(None)  # a padding row
            continue
        history, length = draw(st.integers(0, 7)), draw(st.integers(1, 5))
        prefill = draw(st.booleans())
        rows.append((history, length, prefill, length if prefill else draw(st.integers(0, length))))
    order = draw(st.permutations(range(B)))
    block_size = draw(st.integers(1, 4)) if draw(st.booleans()) else None
    heads = draw(st.sampled_from([(1, 2, 4, 4), (2, 1, 3, 5), (1, 3, 2, 2)]))
    return rows, order, block_size, draw(st.integers(1, 3)), heads, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
@example(([(2, 5, False, 5)], [0], 3, 1, (1, 2, 4, 4), 0))  # a boundary inside, then the final block
@example(([(5, 4, True, 4), None, (0, 3, False, 2)], [2, 1, 0], 2, 2, (2, 1, 3, 5), 1))
def test_mixed_steps_equal_fresh_prefill(step):
    rows, order, block_size, dilation, heads, seed = step
    layers = _stack(dilation, heads)
    gen = torch.Generator().manual_seed(seed)
    B, ncols = len(rows), 12  # up to 7 + 5 tokens: one block each at block_size 1
    hist = [torch.randn(r[0] + r[1], HIDDEN, generator=gen) if r else None for r in rows]
    S = B * ncols if block_size else B
    perm = torch.randperm(S, generator=gen).tolist()  # slot 0 is used by some row
    table = [perm[b * ncols:(b + 1) * ncols] if r else [-1] * ncols for b, r in enumerate(rows)]
    slots = [perm[b] if r else -1 for b, r in enumerate(rows)]
    pool = StatePool(layers, num_slots=S, max_tokens=64)

    def build(idx, lens, prefill, nct):
        if block_size:
            return RecoverSSMMetadata.build(lens, prefill, nct, block_size=block_size,
                                            block_table=[table[b] for b in idx], num_slots=S)
        return RecoverSSMMetadata.build(lens, prefill, nct, [slots[b] for b in idx], num_slots=S)

    # 1. every row's history as prefill rows; 2. one mixed step in a random row order
    idx = list(range(B))
    md = build(idx, [r[0] if r else 0 for r in rows], [True] * B, [0] * B)
    if md.num_tokens:
        _run(layers, torch.cat([hist[b][: rows[b][0]] for b in idx if rows[b]]), md, pool)
    md = build(order, [rows[b][1] if rows[b] else 0 for b in order], [bool(rows[b] and rows[b][2]) for b in order],
               [rows[b][0] if rows[b] else 0 for b in order])
    x = torch.cat([hist[b][rows[b][0]:] for b in order if rows[b]] or [torch.empty(0, HIDDEN)])
    out = _run(layers, x, md, pool)
    commit(pool, md, i32([rows[b][3] if rows[b] else 0 for b in order], "cpu"))
    at = {}
    pos = 0
    for b in order:
        if rows[b]:
            at[b] = pos
            pos += rows[b][1]
    for b, r in enumerate(rows):
        if not r:
            continue
        history, length, _, n = r
        ref_out, _ = _fresh(layers, hist[b])
        assert rel_err(out[at[b]:at[b] + length], ref_out[history:]) < 1e-4
        done = history + n
        if done == 0:
            continue
        _, ref_states = _fresh(layers, hist[b][:done])
        final = table[b][(done - 1) // block_size] if block_size else slots[b]
        for got, want in zip(_states(pool, final), ref_states):
            assert rel_err(got, want) < 1e-4, (b, r, block_size)
        if block_size:
            for c in range(history // block_size, (done - 1) // block_size):  # boundaries crossed
                _, ref_states = _fresh(layers, hist[b][: (c + 1) * block_size])
                for got, want in zip(_states(pool, table[b][c]), ref_states):
                    assert rel_err(got, want) < 1e-4, (b, r, block_size, c)
            for c in range((done - 1) // block_size + 1, ncols):  # never past the last block
                assert all(not s.any() for s in _states(pool, table[b][c])), (b, r, c)
