"""The per-rank body of the tensor-parallel ``DecoderStack`` tests (``tests/modules/test_tensor_parallel.py``):
spec-decode steps of the sharded stack against the unsharded one, and (on GPUs) the sharded
stack's captured step against its eager step. Entry points take ``(rank, world, port, arg,
result_dir, backend="gloo")`` like :mod:`tests.modules.tp_worker`'s."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from tests.modules.tp_worker import _as_rank

#: Small widths: 4 layers (GDN x3, attention), every width divisible by 2 (and by 4 but the KV heads).
WIDTHS = dict(vocab_size=64, hidden_size=32, num_layers=4, intermediate_size=64, num_k_heads=4, num_v_heads=8,
              head_k_dim=16, head_v_dim=16, num_heads=4, num_kv_heads=2, head_dim=8)
SLOTS, MAX_LEN, K_DRAFTS, PROMPT = 4, 96, 3, 6


class _KeepLogits(torch.nn.Module):
    """The model, keeping its last logits (eager steps only)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.logits = model, None

    def forward(self, ids, md, pool):
        self.logits = self.model(ids, md, pool)
        return self.logits


def _stacks(device, num_kv_heads: int):
    from ssm_spec.graphs.stack import DecoderStack

    def build():
        widths = {**WIDTHS, "num_kv_heads": num_kv_heads}
        return DecoderStack(**widths, max_len=MAX_LEN, num_slots=SLOTS, device=device).randomize(0).eval()

    return build(), build().shard_(dist.group.WORLD)


def _prefill(model, pool, prompts: torch.Tensor) -> torch.Tensor:
    """Prefill ``prompts [B, PROMPT]`` into slots ``0..B-1``; returns each row's greedy next token."""
    from ssm_spec import RecoverSSMMetadata

    B = prompts.shape[0]
    md = RecoverSSMMetadata.build([PROMPT] * B, [True] * B, [0] * B, list(range(B)), num_slots=SLOTS,
                                  device=pool.device)
    logits = model(prompts.reshape(-1).to(pool.device), md, pool)
    return logits.view(B, PROMPT, -1)[:, -1].argmax(-1).cpu()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30)).item()


def _shard_views(rank, full, shard, pools):
    """Pairs (unsharded view of this rank's share, sharded tensor) of every state and KV buffer."""
    from ssm_spec import RecoverGatedDeltaNet

    pairs = []
    for mf, ms in zip(full.mixers, shard.mixers):
        if isinstance(mf, RecoverGatedDeltaNet):
            hv, hk, K, V, H = ms.num_v_heads, ms.num_k_heads, mf.head_k_dim, mf.head_v_dim, mf.num_k_heads
            v0, h0 = rank * hv, rank * hk
            pairs.append((pools[0].gdn_state(mf)[:, v0:v0 + hv], pools[1].gdn_state(ms)))
            rows = torch.cat([torch.arange(h0 * K, (h0 + hk) * K), H * K + torch.arange(h0 * K, (h0 + hk) * K),
                              2 * H * K + torch.arange(v0 * V, (v0 + hv) * V)]).to(mf.out_proj.weight.device)
            pairs.append((pools[0].conv_state(mf)[..., rows], pools[1].conv_state(ms)))
        else:
            k0 = (rank * ms.num_heads) // (mf.num_heads // mf.num_kv_heads)
            pairs.append((mf.kv[:, :SLOTS, :, k0:k0 + ms.num_kv_heads], ms.kv[:, :SLOTS]))
    return pairs


def decoder_stack_run(rank: int, world: int, port: int, steps: int, result_dir: str, backend: str = "gloo") -> None:
    """The sharded stack through ``steps`` eager spec-decode steps (the graphs runner's body) on
    the same windows as the unsharded stack, for 2 and (replicated over ranks) 1 KV heads; writes
    ``ok <worst logits/state rel. error> <tokens equal the reference> <ranks agree> <drafts accepted>``
    to ``result_dir/stack<rank>.txt``."""
    _as_rank(rank, world, port, os.path.join(result_dir, f"stack{rank}.txt"),
             lambda dev: _decoder_stack(rank, world, steps, dev), backend)


@torch.no_grad()
def _decoder_stack(rank: int, world: int, steps: int, device) -> str:
    from ssm_spec import StatePool
    from ssm_spec.graphs import SpecDecodeGraphRunner

    V, W, B = WIDTHS["vocab_size"], K_DRAFTS + 1, SLOTS
    worst, same, agree, accepted = 0.0, True, True, 0
    for kv_heads in (WIDTHS["num_kv_heads"], 1):
        full, shard = _stacks(device, kv_heads)
        gen = torch.Generator().manual_seed(kv_heads)
        prompts = torch.randint(0, V, (B, PROMPT), generator=gen)
        # the unsharded model's own greedy continuation (W = 1 steps on a copy): the drafts follow it
        plain_model = copy.deepcopy(full)
        plain_pool = StatePool(plain_model.recurrent_layers(), num_slots=SLOTS, max_tokens=B, device=device)
        nxt = _prefill(plain_model, plain_pool, prompts)
        plain = SpecDecodeGraphRunner(plain_model, plain_pool, 0, V, buckets=(B,), capture=False)
        rollout, nct = [nxt], torch.full((B,), PROMPT, dtype=torch.int32)
        for _ in range(steps * W):
            tok, _ = plain.step(rollout[-1][:, None].to(device), torch.ones(B, dtype=torch.int32, device=device),
                                torch.arange(B, dtype=torch.int32, device=device), nct.to(device))
            rollout.append(tok[:, 0].cpu().clone())  # a view of the static output otherwise
            nct += 1
        rollout = torch.stack(rollout, 1)  # [B, 1 + steps * W]: rollout[:, j] follows the prompt's j tokens
        models = [_KeepLogits(m) for m in (full, shard)]
        pools = [StatePool(m.recurrent_layers(), num_slots=SLOTS, max_tokens=B * W, device=device)
                 for m in (full, shard)]
        last = [_prefill(m, p, prompts) for m, p in zip(models, pools)]
        same &= torch.equal(last[0], last[1])
        runners = [SpecDecodeGraphRunner(m, p, K_DRAFTS, V, buckets=(B,), capture=False) for m, p in zip(models, pools)]
        pos, last = torch.zeros(B, dtype=torch.int64), last[0]  # tokens generated after the prompt
        for _ in range(steps):
            window = torch.empty(B, W, dtype=torch.int64)
            window[:, 0] = last
            for b in range(B):
                drafts = rollout[b, pos[b] + 1:pos[b] + W].clone()
                wrong = torch.rand(K_DRAFTS, generator=gen) < 0.3  # some drafts off the greedy path
                drafts[wrong] = (drafts[wrong] + 1 + torch.randint(0, V - 1, (int(wrong.sum()),), generator=gen)) % V
                window[b, 1:] = drafts
            args = (window.to(device), torch.full((B,), W, dtype=torch.int32, device=device),
                    torch.arange(B, dtype=torch.int32, device=device), (PROMPT + pos).to(torch.int32).to(device))
            outs = [[t.clone().cpu() for t in r.step(*args)] for r in runners]
            worst = max(worst, _rel(models[0].logits, models[1].logits))
            same &= all(torch.equal(a, b) for a, b in zip(*outs))
            mine = torch.cat([outs[1][0].flatten(), outs[1][1].long()])
            sent = mine.to(device)  # NCCL gathers into CUDA tensors only: the outputs on the rank's device too
            ranks = [torch.empty_like(sent) for _ in range(world)]
            dist.all_gather(ranks, sent)
            agree &= all(torch.equal(r.cpu(), mine) for r in ranks)
            tokens, counts = outs[0]
            accepted += int(counts.sum()) - B
            last = tokens[torch.arange(B), counts.long() - 1]
            pos += counts.long()
        for a, b in _shard_views(dist.get_rank(), full, shard, pools):
            worst = max(worst, _rel(a, b))
    return f"ok {worst:.3e} {int(same)} {int(agree)} {accepted}"


def capture_run(rank: int, world: int, port: int, batch: int, result_dir: str, backend: str = "nccl") -> None:
    """GPU only: the sharded stack's captured step (a CUDA graph holding the NCCL all-reduces)
    replayed on the same buffers and states as its eager step, bit for bit; writes
    ``ok <logits... equal> <states equal>`` to ``result_dir/capture<rank>.txt``."""
    _as_rank(rank, world, port, os.path.join(result_dir, f"capture{rank}.txt"),
             lambda dev: _capture(batch, dev), backend)


@torch.no_grad()
def _capture(batch: int, device) -> str:
    from ssm_spec import StatePool
    from ssm_spec.graphs import SpecDecodeGraphRunner

    V, W = WIDTHS["vocab_size"], K_DRAFTS + 1
    _, shard = _stacks(device, WIDTHS["num_kv_heads"])
    pool = StatePool(shard.recurrent_layers(), num_slots=SLOTS, max_tokens=SLOTS * W, device=device)
    gen = torch.Generator().manual_seed(batch)
    last = _prefill(shard, pool, torch.randint(0, V, (SLOTS, PROMPT), generator=gen))
    runner = SpecDecodeGraphRunner(shard, pool, K_DRAFTS, V, buckets=(batch,)).capture()
    if not runner.graphs:
        raise RuntimeError("nothing was captured (not a CUDA pool?)")
    window = torch.randint(0, V, (batch, W), generator=gen)
    window[:, 0] = last[:batch]
    runner.window_tokens[:batch].copy_(window)
    runner.window_lens[:batch].fill_(W)
    runner.state_indices[:batch].copy_(torch.arange(batch, dtype=torch.int32))
    runner.num_computed_tokens[:batch].fill_(PROMPT)

    def states():
        return [s for s, _ in (*pool.gdn_groups.values(), *pool.conv_groups.values())] + shard.kv_buffers()

    start = [t.clone() for t in states()]
    eager = [t.clone() for t in runner.eager_step(batch)]
    after_eager = [t.clone() for t in states()]
    for t, s in zip(states(), start):
        t.copy_(s)
    runner.accepted_tokens.fill_(-1)  # the eager step left its outputs in these static buffers: the
    runner.num_accepted_tokens.fill_(-1)  # replay must write them again for the comparison to mean anything
    runner.replay(batch)
    torch.cuda.synchronize()
    out_equal = torch.equal(runner.accepted_tokens[:batch], eager[0]) and \
        torch.equal(runner.num_accepted_tokens[:batch], eager[1])
    states_equal = all(torch.equal(a[:, :SLOTS], b[:, :SLOTS]) for a, b in zip(states(), after_eager))
    return f"ok {int(out_equal)} {int(states_equal)}"
