"""A small Hugging Face-style decoder written from scratch around ssm-spec's modules.

Layers: a Qwen3-Next GDN layer, a dilated PLE short conv, an attention layer over a static
per-row KV buffer (harness, not library: docs/design.md section 8), and an MLP, with random
weights. It decodes greedily twice: token by token, and speculatively (k random-ish drafts
per step, verified in one window, greedy acceptance, one commit for all layers), and checks
that both give the same tokens.

    python examples/custom_qwen_fork.py [--tokens 48] [--k 3] [--device cpu]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, RecoverSSMMetadata, StatePool, commit


class KVAttention(nn.Module):
    """Causal single-head-group attention over a static ``[slots, max_len, heads, dim]`` buffer."""

    def __init__(self, hidden, heads, max_len, slots):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.register_buffer("kv", torch.zeros(2, slots, max_len, heads, self.dim), persistent=False)

    def forward(self, x, slot, start):
        """``x [T, hidden]``: tokens at positions ``start..start+T-1`` of request ``slot``."""
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.heads, self.dim).unbind(1)
        self.kv[0, slot, start:start + T] = k  # rejected drafts are overwritten later
        self.kv[1, slot, start:start + T] = v
        keys, values = self.kv[0, slot, :start + T], self.kv[1, slot, :start + T]
        mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                           attn_mask=mask)
        return self.out(o.transpose(0, 1).reshape(T, -1))


class TinyQwenFork(nn.Module):
    def __init__(self, vocab=64, hidden=32, max_len=256, slots=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.gdn = RecoverGatedDeltaNet(hidden, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
        self.ple = RecoverShortConv(hidden, kernel_size=3, dilation=2)
        self.attn = KVAttention(hidden, heads=4, max_len=max_len, slots=slots)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def recurrent_layers(self):
        return [self.gdn, self.ple]

    def forward(self, tokens, metadata, pool, slot, start):
        """Logits ``[T, vocab]`` for one request's tokens at positions ``start..``."""
        h = self.embed(tokens)
        h = h + self.gdn(h, metadata, pool)
        h = h + self.ple(h, metadata, pool)
        h = h + self.attn(h, slot, start)
        h = h + self.mlp(h)
        return self.lm_head(self.norm(h))


def _step(model, pool, tokens, slot, done, prefill):
    md = RecoverSSMMetadata.build([len(tokens)], [prefill], [done], [slot], num_slots=pool.num_slots,
                                  device=tokens.device)
    return model(tokens, md, pool, slot, done), md


@torch.no_grad()
def greedy(model, pool, prompt, max_new, slot=0):
    """Plain greedy decoding: prefill, then one token per step (a verify of 1, commit 1)."""
    logits, _ = _step(model, pool, prompt, slot, 0, True)
    out = [int(logits[-1].argmax())]
    done = len(prompt)
    while len(out) < max_new:
        logits, md = _step(model, pool, torch.tensor([out[-1]], device=prompt.device), slot, done, False)
        commit(pool, md, torch.ones(1, dtype=torch.int32, device=prompt.device))
        done += 1
        out.append(int(logits[-1].argmax()))
    return out


@torch.no_grad()
def speculative(model, pool, prompt, max_new, k, propose, slot=1):
    """Greedy speculative decoding: a window of the last token and ``k`` drafts is verified in
    one forward; the accepted prefix is committed to every recurrent layer at once."""
    logits, _ = _step(model, pool, prompt, slot, 0, True)
    out = [int(logits[-1].argmax())]
    done, accepted = len(prompt), []
    while len(out) < max_new:
        window = [out[-1]] + propose(len(out), k)
        logits, md = _step(model, pool, torch.tensor(window, device=prompt.device), slot, done, False)
        target = logits.argmax(-1).tolist()
        n = 1  # the last token is always consumed; each matching draft adds one
        while n < len(window) and window[n] == target[n - 1]:
            n += 1
        commit(pool, md, torch.tensor([n], dtype=torch.int32, device=prompt.device))
        done += n
        accepted.append(n - 1)
        out.extend(window[1:n] + [target[n - 1]])
    return out[:max_new], accepted


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model = TinyQwenFork().to(args.device).eval()
    for p in model.gdn.parameters():  # sharper gates than the default init, for a livelier state
        p.data.normal_(std=0.3)
    pool = StatePool(model.recurrent_layers(), num_slots=2, max_tokens=64, device=args.device)
    prompt = torch.randint(0, 64, (12,), device=args.device)
    plain = greedy(model, pool, prompt, args.tokens)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def propose(position, k):  # drafts: the true continuation, corrupted at random
        drafts = plain[position:position + k] + [0] * k
        return [t if torch.rand((), generator=gen) < 0.7 else int(torch.randint(0, 64, (), generator=gen))
                for t in drafts[:k]]

    spec, accepted = speculative(model, pool, prompt, args.tokens, args.k, propose)
    print("plain      :", plain)
    print("speculative:", spec)
    print(f"steps {len(accepted)} for {args.tokens} tokens, mean accepted drafts {sum(accepted) / len(accepted):.2f}"
          f" of {args.k}")
    print("identical  :", spec == plain)
    return 0 if spec == plain else 1


if __name__ == "__main__":
    raise SystemExit(main())
