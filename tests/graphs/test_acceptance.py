"""ssm_spec.graphs.acceptance: greedy matching and speculative rejection sampling on the device."""

import pytest
import torch

from ssm_spec.graphs.acceptance import greedy_accept, rejection_sample_accept


def _greedy_ref(window, lens, logits, pad):
    """Token-by-token reference of greedy acceptance."""
    B, W = window.shape
    out = torch.full((B, W), pad, dtype=torch.int64)
    n = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        a = 0
        while a < L - 1 and int(window[b, a + 1]) == int(logits[b, a].argmax()):
            out[b, a] = window[b, a + 1]
            a += 1
        out[b, a] = logits[b, a].argmax()
        n[b] = a + 1
    return out, n


def test_greedy_equals_token_by_token_reference(device):
    gen = torch.Generator().manual_seed(0)
    B, W, V = 64, 5, 7
    logits = torch.randn(B, W, V, generator=gen)
    choice = logits.argmax(-1)
    window = torch.randint(0, V, (B, W), generator=gen)
    agree = torch.rand(B, W - 1, generator=gen) < 0.7  # drafts that match the target mostly
    window[:, 1:] = torch.where(agree, choice[:, :-1], window[:, 1:])
    lens = torch.randint(0, W + 1, (B,), generator=gen)  # ragged windows and padding rows
    want = _greedy_ref(window, lens, logits, pad=-1)
    got = greedy_accept(window.to(device), lens.to(device), logits.to(device), pad_token=-1)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert set(want[1].tolist()) >= {0, 1, W}  # padding, nothing accepted, everything accepted


def test_rejection_sampling_extremes(device):
    gen = torch.Generator().manual_seed(1)
    B, W, V = 256, 4, 6
    logits = torch.randn(B, W, V, generator=gen) * 2
    p = torch.softmax(logits, -1)
    window = torch.zeros(B, W, dtype=torch.int64)
    window[:, 1:] = torch.multinomial(p[:, :-1].reshape(-1, V), 1, generator=gen).view(B, W - 1)
    lens = torch.full((B,), W)
    dgen = torch.Generator(device=device).manual_seed(0)
    toks, n = rejection_sample_accept(window.to(device), lens.to(device), logits.to(device),
                                      p[:, :-1].to(device), generator=dgen)
    assert bool((n == W).all())  # draft distribution == target: every draft accepted
    assert torch.equal(toks[:, :W - 1].cpu(), window[:, 1:])
    # disjoint supports: the drafts are tokens the target gives probability 0
    logits = torch.full((B, W, V), -1e9)
    logits[..., :3] = torch.randn(B, W, 3, generator=gen)
    q = torch.zeros(B, W - 1, V)
    q[..., 3:] = 1 / 3
    window[:, 1:] = 3 + torch.randint(0, 3, (B, W - 1), generator=gen)
    toks, n = rejection_sample_accept(window.to(device), lens.to(device), logits.to(device), q.to(device),
                                      generator=dgen)
    assert bool((n == 1).all()) and bool((toks[:, 0] < 3).all())  # none accepted; bonus from p


# chi-square critical value for 3 degrees of freedom at p = 0.01 (NIST/SEMATECH e-Handbook of
# Statistical Methods, table 1.3.6.7.4): a fit is rejected only above it
CHI2_3DF_P01 = 11.345


@pytest.mark.parametrize("window_len", [2, 3])
def test_rejection_sampling_output_distribution_is_the_target(device, window_len):
    """One draft per row drawn from q != p: the first output token is distributed as p
    (the bonus after a rejection fills in exactly the missing mass); ragged rows use p."""
    V, B, W = 4, 40000, 3
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q0 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    gen = torch.Generator().manual_seed(2)
    logits = torch.log(p0).expand(B, W, V).clone()
    q = q0.expand(B, W - 1, V).clone()
    window = torch.zeros(B, W, dtype=torch.int64)
    window[:, 1:] = torch.multinomial(q0, B * (W - 1), replacement=True, generator=gen).view(B, W - 1)
    lens = torch.full((B,), window_len)
    dgen = torch.Generator(device=device).manual_seed(3)
    toks, n = rejection_sample_accept(window.to(device), lens.to(device), logits.to(device), q.to(device),
                                      generator=dgen)
    counts = torch.bincount(toks[:, 0].cpu(), minlength=V).double()
    expected = p0.double() * B
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_3DF_P01, (chi2, counts.tolist())
    assert int(n.max()) <= window_len


def test_acceptance_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="window_tokens"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2), torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2), torch.zeros(2, 3, 5),
                                torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2), torch.zeros(2, 3, 5),
                                torch.zeros(2, 2, 5), temperature=0.0)


def test_acceptance_compiles_without_graph_breaks():
    """Both rules trace as one graph (no .item(), no data-dependent shapes)."""
    gen = torch.Generator().manual_seed(4)
    B, W, V = 8, 4, 5
    logits = torch.randn(B, W, V, generator=gen)
    window = torch.randint(0, V, (B, W), generator=gen)
    lens = torch.randint(0, W + 1, (B,), generator=gen)
    want = greedy_accept(window, lens, logits)
    got = torch.compile(greedy_accept, fullgraph=True)(window, lens, logits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q = torch.softmax(torch.randn(B, W - 1, V, generator=gen), -1)
    toks, n = torch.compile(rejection_sample_accept, fullgraph=True)(window, lens, logits, q)
    assert toks.shape == (B, W) and bool(((n >= 1) | (lens == 0)).all()) and bool((n <= lens.clamp_min(0)).all())
