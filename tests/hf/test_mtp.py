"""The checkpoint's own MTP head as the decode loop's drafter (docs/design.md section 7.8):
``generate(..., use_mtp=True, num_assistant_tokens=k)`` on a converted model.

* The drafter's logits equal an independent float64 implementation of the published head
  (written out here from the architecture vLLM and SGLang define: Gemma RMSNorms, ``fc`` over
  ``[embedding, hidden]``, one gated full-attention layer with partial rotary embeddings, a dense
  or expert MLP, ``norm``, the target's LM head; the target's hidden states after its final
  norm), at every round of left-padded batches whose acceptance is forced to ragged counts, so
  the head's KV rollback is exercised at every accepted length.
* Greedy fp32 tokens with ``use_mtp=True`` equal plain greedy of the unconverted model, from
  tiny checkpoints with random ``mtp.*`` tensors saved beside the model (one file and sharded),
  batch 1 and left-padded batches, ``k`` 1 and 3.
* Every refusal is a ``ValueError`` naming its cause, and a failed load leaves nothing behind.

The random heads draft badly (few drafts are accepted): the exactness tests only check that the
drafter ran.
"""

import copy
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from ssm_spec.hf import acceptance_stats, apply_recoverssm, is_converted, tiny_model  # noqa: E402
from tests.helpers import widen_prompts  # noqa: E402
from ssm_spec.hf.tiny import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
TEXTS = ["the cat sat on the mat. the cat", "a b c a b", "xy"]
NEW = 12
INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------- checkpoints
def _count_name(kind: str) -> str:
    return "num_nextn_predict_layers" if kind.startswith("qwen3_next") else "mtp_num_hidden_layers"


def _is_moe(kind: str) -> bool:
    return kind in ("qwen3_next_moe", "qwen3_5_moe", "qwen3_5_moe_vl")


def _mtp_shapes(kind: str, cfg, layers: int = 1) -> dict:
    """The published ``mtp.*`` names and shapes for the text config ``cfg`` (hf_mtp.md): Qwen3-Next
    experts one tensor per expert, Qwen3.5-MoE experts fused."""
    H, nh, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    for l in range(layers):
        p = f"mtp.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (2 * nh * hd, H), p + "self_attn.k_proj.weight": (kvh * hd, H),
                       p + "self_attn.v_proj.weight": (kvh * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if not _is_moe(kind):
            inter = cfg.intermediate_size
            shapes.update({p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                           p + "mlp.down_proj.weight": (H, inter)})
            continue
        E, inter, shared = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update({p + "mlp.gate.weight": (E, H), p + "mlp.shared_expert.gate_proj.weight": (shared, H),
                       p + "mlp.shared_expert.up_proj.weight": (shared, H),
                       p + "mlp.shared_expert.down_proj.weight": (H, shared),
                       p + "mlp.shared_expert_gate.weight": (1, H)})
        if kind.startswith("qwen3_next"):
            for e in range(E):
                shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (inter, H),
                               f"{p}mlp.experts.{e}.up_proj.weight": (inter, H),
                               f"{p}mlp.experts.{e}.down_proj.weight": (H, inter)})
        else:
            shapes.update({p + "mlp.experts.gate_up_proj": (E, 2 * inter, H), p + "mlp.experts.down_proj": (E, H, inter)})
    return shapes


def write_checkpoint(path, kind, seed=0, *, sharded=False, layers=1, count=None, tensors=True, copy_token=False):
    """``tiny_model(kind, seed)`` saved with ``save_pretrained`` into ``path`` (sharded: several
    files and an index), its config declaring ``count`` MTP layers (default ``layers``), and
    random ``mtp.*`` tensors of ``layers`` layers added (sharded: into two more files named by
    the index). Returns ``{name: tensor}`` of what was added.

    ``copy_token``: a head that passes the next token's embedding through (``fc = [I, 0]``, the
    norms' weights 0, the layer's output projections scaled by 0.1): the tiny models' residual
    stream leans on the current token, so this drafter is accepted at times (greedy and sampled),
    where a random head almost never is."""
    model = tiny_model(kind, seed=seed)
    cfg = model.config.get_text_config()
    setattr(cfg, _count_name(kind), layers if count is None else count)
    if sharded:
        model.save_pretrained(path, max_shard_size="150KB")
    else:
        model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1000 + seed)
    added = {}
    if tensors:
        for name, shape in _mtp_shapes(kind, cfg, layers).items():
            added[name] = torch.randn(shape, generator=gen) * (0.3 if len(shape) == 1 else 0.2)
            if copy_token and name.endswith("norm.weight"):
                added[name].zero_()
            elif copy_token and name.endswith(("o_proj.weight", "down_proj.weight")):
                added[name].mul_(0.1)
        if copy_token:
            H = cfg.hidden_size
            added["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    if sharded:
        index = json.loads((path / INDEX).read_text())
        assert len(set(index["weight_map"].values())) > 1
        names = sorted(added)
        for i, part in enumerate((names[::2], names[1::2])):
            if part:
                save_file({n: added[n] for n in part}, str(path / f"mtp-{i}.safetensors"), metadata={"format": "pt"})
                index["weight_map"].update({n: f"mtp-{i}.safetensors" for n in part})
        (path / INDEX).write_text(json.dumps(index))
    else:
        weights = load_file(str(path / "model.safetensors"))
        weights.update(added)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return added


_MADE = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(kind, sharded=False, copy_token=False)`` -> ``(path, mtp tensors)``, written
    once per module."""

    def get(kind, sharded=False, copy_token=False):
        key = (kind, sharded, copy_token)
        if key not in _MADE:
            path = tmp_path_factory.mktemp(f"{kind}_{'sharded' if sharded else 'single'}{'_copy' if copy_token else ''}")
            _MADE[key] = (path, write_checkpoint(path, kind, seed=3, sharded=sharded, copy_token=copy_token))
        return _MADE[key]

    return get


def _load(path, kind, device="cpu"):
    """The checkpoint at ``path`` loaded with transformers (the class ``kind`` names)."""
    from ssm_spec.hf.tiny import KINDS

    return getattr(transformers, KINDS[kind]).from_pretrained(path).to(device).eval()


def _batch(texts, device="cpu"):
    from tests.hf.test_decode_loop import _batch as left_padded

    return left_padded(texts, device)


def _own(ref, texts, n, device):
    return [ref.generate(torch.tensor([TOK.encode(t)], device=device), max_new_tokens=n, do_sample=False)[0]
            [len(TOK.encode(t)):] for t in texts]


def _check_rows(out, prompt_len, own, pad_id):
    for b, tokens in enumerate(own):
        got = out[b, prompt_len:]
        assert torch.equal(got[:len(tokens)], tokens), (b, got.tolist(), tokens.tolist())
        assert (got[len(tokens):] == pad_id).all(), (b, got.tolist())


# ---------------------------------------------------------------------------------------- the reference
def _rms(x, w, eps):
    """Gemma-style RMSNorm: ``x / rms(x) * (1 + w)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, pos, cfg):
    """Rotary embedding of ``x [L, heads, hd]`` at ``pos [L]`` on the first
    ``hd * partial_rotary_factor`` dims (halves rotated). Qwen3.5's multi-axis rotary is this one
    for text, where its three position axes are equal."""
    rope = cfg.rope_parameters
    dim = int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0))
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    xr, rest = x[..., :dim], x[..., dim:]
    rotated = torch.cat([-xr[..., dim // 2:], xr[..., :dim // 2]], -1)
    return torch.cat([xr * cos + rotated * sin, rest], -1)


class ReferenceHead:
    """The published MTP head in float64 over one unpadded row, from the checkpoint's tensors by
    name; no cache (every call runs the whole causal sequence of pairs)."""

    def __init__(self, kind, cfg, tensors, embed, lm_head):
        self.kind, self.cfg = kind, cfg
        self.w = {n: t.double() for n, t in tensors.items()}
        self.embed, self.lm_head = embed.double(), lm_head.double()
        self.eps = cfg.rms_norm_eps

    def _attention(self, x, pos, p):
        cfg, w = self.cfg, self.w
        L, nh, kvh, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, gate = (x @ w[p + "q_proj.weight"].T).view(L, nh, 2 * hd).chunk(2, dim=-1)
        q = _rope(_rms(q, w[p + "q_norm.weight"], self.eps), pos, cfg)
        k = _rope(_rms((x @ w[p + "k_proj.weight"].T).view(L, kvh, hd), w[p + "k_norm.weight"], self.eps), pos, cfg)
        v = (x @ w[p + "v_proj.weight"].T).view(L, kvh, hd)
        k, v = k.repeat_interleave(nh // kvh, dim=1), v.repeat_interleave(nh // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(L, nh * hd)
        return (out * torch.sigmoid(gate.reshape(L, nh * hd))) @ w[p + "o_proj.weight"].T

    def _swiglu(self, x, gate, up, down):
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    def _mlp(self, x, p):
        w = self.w
        if not _is_moe(self.kind):
            return self._swiglu(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
        cfg = self.cfg
        E, K = cfg.num_experts, cfg.num_experts_per_tok
        probs = torch.softmax(x @ w[p + "gate.weight"].T, -1)
        top, idx = probs.topk(K, dim=-1)
        if getattr(cfg, "norm_topk_prob", True):
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            if p + "experts.gate_up_proj" in w:
                gate, up = w[p + "experts.gate_up_proj"][e].chunk(2, dim=0)
                down = w[p + "experts.down_proj"][e]
            else:
                gate, up, down = (w[f"{p}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            weight = (top * (idx == e)).sum(-1, keepdim=True)
            out = out + weight * self._swiglu(x, gate, up, down)
        shared = self._swiglu(x, w[p + "shared_expert.gate_proj.weight"], w[p + "shared_expert.up_proj.weight"],
                              w[p + "shared_expert.down_proj.weight"])
        return out + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * shared

    def outputs(self, hidden, tokens):
        """The head's outputs ``g [L, H]`` for pairs ``(hidden[t], tokens[t])`` at positions ``t``."""
        w, eps = self.w, self.eps
        e = _rms(self.embed[tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
        h = _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
        z = torch.cat([e, h], -1) @ w["mtp.fc.weight"].T
        pos = torch.arange(z.shape[0])
        p = "mtp.layers.0."
        z = z + self._attention(_rms(z, w[p + "input_layernorm.weight"], eps), pos, p + "self_attn.")
        z = z + self._mlp(_rms(z, w[p + "post_attention_layernorm.weight"], eps), p + "mlp.")
        return _rms(z, w["mtp.norm.weight"], eps)

    def draft_logits(self, hidden, seq, drafts):
        """The logits of draft steps ``0 .. len(drafts) - 1`` after the row ``seq [L + 1]`` whose
        target hidden states are ``hidden [L + 1, H]``: the pairs ``(h[t], x[t + 1])``, then each
        step's pair (the previous output, the previous draft)."""
        hs, xs = [hidden[t] for t in range(len(seq) - 1)], [int(t) for t in seq[1:]]
        out = []
        for j in range(len(drafts)):
            g = self.outputs(torch.stack(hs), torch.tensor(xs))
            out.append(g[-1] @ self.lm_head.T)
            hs.append(g[-1])
            xs.append(int(drafts[j]))
        return torch.stack(out)


def _forced_acceptance(counter):
    """``accept_greedy`` with the accepted counts forced to ``(round + row) mod (k + 1)``: the
    kept drafts, then the target's own token at the first one refused (every length of rollback,
    ragged across the rows)."""

    def accept(drafts, num_drafts, scores):
        choice = scores.argmax(-1)
        B, k = drafts.shape
        a = (torch.arange(B, device=drafts.device) + counter[0]) % (k + 1)
        counter[0] += 1
        j = torch.arange(k + 1, device=drafts.device)[None, :]
        padded = torch.cat([drafts, drafts[:, :1]], dim=1)
        return torch.where(j < a[:, None], padded, choice), a

    return accept


@pytest.mark.parametrize("kind,sharded,widen", [("qwen3_next", False, 0), ("qwen3_5", True, 7),
                                                ("qwen3_next_moe", True, 0), ("qwen3_5_moe", False, 0),
                                                ("qwen3_5_vl", False, 5)])
def test_the_drafters_logits_are_the_published_heads(kind, sharded, widen, checkpoint, monkeypatch):
    """Left-padded rows of three lengths, ``k = 3``, acceptance forced to every count from 0 to 3:
    at every round, each row's draft logits equal the float64 reference head's on that row alone
    (the target's own hidden states after its final norm, the drafts fed back). ``widen``: the
    loop runs the prompt that many columns wider (more left padding), as it does under CUDA
    graphs to share a captured prefill."""
    from ssm_spec.hf.loop import mtp as mtp_module
    from ssm_spec.hf.loop import runner

    if widen:
        widen_prompts(monkeypatch, widen)

    path, tensors = checkpoint(kind, sharded)
    model = apply_recoverssm(_load(path, kind))
    ref = tiny_model(kind, seed=3, dtype=torch.float64)  # the target, for its hidden states
    if _is_moe(kind):
        ref.set_experts_implementation("eager")  # transformers' default grouped product has no float64
    cfg = ref.config.get_text_config()
    reference = ReferenceHead(kind, cfg, tensors, ref.get_input_embeddings().weight, ref.get_output_embeddings().weight)
    records = []
    propose = mtp_module.MTPDrafter.propose

    def recording(self, rows):
        seen, head = [], self.lm_head
        self.lm_head = lambda g: seen.append(head(g)) or seen[-1]
        try:
            drafts, count, probs = propose(self, rows)
        finally:
            self.lm_head = head
        records.append((rows.tokens.clone(), (rows.start + rows.produced - 1).clone(), rows.pad.clone(),
                        rows.finished.clone(), drafts.clone(), torch.stack(seen, 1).double()))
        return drafts, count, probs

    counter = [0]
    monkeypatch.setattr(mtp_module.MTPDrafter, "propose", recording)
    monkeypatch.setattr(runner, "accept_greedy", _forced_acceptance(counter))
    ids, mask = _batch(TEXTS)
    model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, use_mtp=True, num_assistant_tokens=3)
    assert len(records) >= 3 and counter[0] == len(records)
    assert int(model._recoverssm.loop.rows.start[0]) == ids.shape[1] + widen
    checked, worst = 0, 0.0
    for tokens, last, pad, finished, drafts, logits in records:
        for b in range(len(TEXTS)):
            if finished[b]:
                continue
            seq = tokens[b, pad[b]:last[b] + 1]
            with torch.no_grad():
                hidden = ref.base_model(input_ids=seq[None]).last_hidden_state[0]
                want = reference.draft_logits(hidden, seq, drafts[b])
            err = float((logits[b] - want).abs().max() / want.abs().max())
            worst = max(worst, err)
            assert err < 1e-5, (kind, b, int(last[b]), err)
            checked += 1
    assert checked >= 6, checked


# ---------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_greedy_with_the_mtp_head_equals_plain_greedy(device, kind, sharded, checkpoint):
    """The head read from the checkpoint the model was loaded from (one file of a random head, or
    shards and an index of a token-copying head that is accepted at times): batch 1 and a
    left-padded batch of three, ``k`` 1 and 3, every row its own plain greedy of the unconverted
    model; the drafter ran (rounds and drafts counted), and the token-copying head on Qwen3-Next
    had drafts accepted."""
    path, _ = checkpoint(kind, sharded, copy_token=sharded)
    accepted = 0
    ref = _load(path, kind, device)
    model = apply_recoverssm(_load(path, kind, device), cuda_graphs=device.type == "cuda")
    own = _own(ref, TEXTS, NEW, device)
    for rows in (1, 3):
        ids, mask = _batch(TEXTS[:rows], device)
        for k in (1, 3):
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # the decode loop ran: no fallback, no failed capture
                out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_mtp=True,
                                     num_assistant_tokens=k)
            _check_rows(out, ids.shape[1], own[:rows], TOK.pad_token_id)
            stats = acceptance_stats(model)
            assert 0 < stats.drafted <= k * stats.rounds, (rows, k, stats)
            accepted += stats.accepted
            if device.type == "cuda":
                loop = model._recoverssm.loop
                assert loop.graph is not None and loop.eager_rounds == 0
    assert accepted > 0 or not (sharded and kind == "qwen3_next"), accepted


def test_compiled_head_steps_stay_exact_in_one_graph_per_shape(checkpoint):
    """``compile=True``: the head's draft steps and its pass over the window run compiled
    (fullgraph: a break would raise) in one graph each for k = 2 and a batch of three, with
    plain greedy's tokens for every row and the same drafts as the eager head within rounding
    (the same acceptance)."""
    from torch._dynamo.utils import counters

    path, _ = checkpoint("qwen3_5", False, copy_token=True)
    ref = _load(path, "qwen3_5")
    ids, mask = _batch(TEXTS)
    own = _own(ref, TEXTS, NEW, "cpu")
    runs = {}
    for setting in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = apply_recoverssm(_load(path, "qwen3_5"), compile=setting)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_mtp=True,
                             num_assistant_tokens=2)
        _check_rows(out, ids.shape[1], own, TOK.pad_token_id)
        runs[setting] = acceptance_stats(model)
        graphs = dict(counters["stats"]).get("unique_graphs", 0)
    # compiled: the target's verify forward (W = 3), the head's step (L = 1) and its window pass (L = 3),
    # the rows' append of the prefill's token (W = 1) and of a round's (W = 3), the counters
    assert graphs == 6, dict(counters["stats"])
    assert runs[True].accepted == runs[False].accepted and runs[True].rounds == runs[False].rounds


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "qwen3_5_moe_vl"])
def test_expert_and_vision_language_classes_equal_plain_greedy(kind, tmp_path):
    """Expert MTP layers (Qwen3-Next's per-expert tensors, Qwen3.5-MoE's fused ones) and a
    vision-language class's text model; the head given by path to a model built in memory
    (``apply_recoverssm(model, mtp=PATH)``)."""
    write_checkpoint(tmp_path, kind, seed=4, sharded=kind.startswith("qwen3_next"))
    ref = tiny_model(kind, seed=4)
    model = tiny_model(kind, seed=4)
    setattr(model.config.get_text_config(), _count_name(kind), 1)
    apply_recoverssm(model, mtp=tmp_path)
    ids, mask = _batch(TEXTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_mtp=True,
                         num_assistant_tokens=2)
    _check_rows(out, ids.shape[1], _own(ref, TEXTS, NEW, "cpu"), TOK.pad_token_id)
    assert acceptance_stats(model).drafted > 0


def test_two_mtp_layers_draft_in_turn_and_stay_exact(tmp_path):
    """A head of two layers (step ``j`` runs layer ``j mod 2``): the tokens stay plain greedy's."""
    write_checkpoint(tmp_path, "qwen3_5", seed=5, layers=2)
    ref, model = _load(tmp_path, "qwen3_5"), apply_recoverssm(_load(tmp_path, "qwen3_5"))
    assert model._recoverssm.mtp is None  # read on the first call that asks for it
    ids, mask = _batch(TEXTS[:2])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_mtp=True,
                         num_assistant_tokens=3)
    _check_rows(out, ids.shape[1], _own(ref, TEXTS[:2], NEW, "cpu"), TOK.pad_token_id)
    assert model._recoverssm.mtp.num_layers == 2 and acceptance_stats(model).drafted > 0


def test_sampling_with_the_mtp_head_is_distributed_as_plain_sampling(checkpoint):
    """``do_sample=True`` with top-3 sampling and a token-copying head (drafts kept and refused):
    drafts drawn from the head's warped distribution and checked by speculative rejection
    sampling against it; the joint law of the first three new tokens, computed exactly from the
    model, against 2,048 rows (chi-square, as tests/hf/test_decode_loop.py checks the other
    drafters)."""
    from tests.hf.test_decode_loop import _chi_square_p, _exact_law

    path, _ = checkpoint("qwen3_next", copy_token=True)
    model = apply_recoverssm(_load(path, "qwen3_next"))
    ids = torch.tensor([TOK.encode("the cat sat")])
    law = _exact_law(tiny_model("qwen3_next", seed=3), ids, top_k=3)
    rows, calls = 1024, 2
    torch.manual_seed(0)
    counts = {}
    for _ in range(calls):
        out = model.generate(ids.repeat(rows, 1), max_new_tokens=3, do_sample=True, top_k=3, top_p=1.0,
                             temperature=1.0, use_mtp=True, num_assistant_tokens=2)
        for row in out[:, ids.shape[1]:].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    stats = acceptance_stats(model)
    assert 0 < stats.accepted < stats.drafted <= 2 * stats.rounds, stats  # drafts kept and refused: both paths
    assert _chi_square_p(counts, law, rows * calls) > 1e-3, sorted(counts.items(), key=lambda x: -x[1])[:6]


# ---------------------------------------------------------------------------------------- refusals
def _state(model):
    return {n: t.clone() for n, t in model.state_dict().items()}


def _same_state(model, before):
    after = model.state_dict()
    return set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)


@pytest.mark.parametrize("damage,match", [
    ("none", r"no mtp\.\* tensors in .*model\.safetensors"),
    ("missing", r"lacks mtp\.fc\.weight"),
    ("shape", r"shapes that do not fit the model: mtp\.fc\.weight \(64, 64\)"),
    ("unexpected", r"does not hold: mtp\.layers\.1\."),
    ("count0", r"num_nextn_predict_layers=0"),
    ("nocount", r"sets neither mtp_num_hidden_layers .* nor num_nextn_predict_layers"),
    ("expert", r"missing mtp\.layers\.0\.mlp\.experts\.3\.down_proj\.weight"),
    ("shard", r"mtp-1\.safetensors .*is missing"),
    ("truncated", r"mtp-0\.safetensors cannot be read as safetensors weights \(SafetensorError"),
    ("fraction", r"num_nextn_predict_layers=1\.5: expected an integer count"),
])
def test_a_bad_checkpoint_is_refused_and_nothing_is_loaded(damage, match, tmp_path):
    """Each fault, through ``apply_recoverssm(model, mtp=PATH)`` on an unconverted model (which
    stays unconverted and unchanged) and on a converted one holding a head (which keeps it), and
    through ``generate(use_mtp=True)`` on a model loaded from the checkpoint (which keeps none)."""
    from ssm_spec.hf import load_mtp_head

    kind = "qwen3_next_moe" if damage == "expert" else "qwen3_next"
    good = tmp_path / "good"
    bad = tmp_path / "bad"
    write_checkpoint(good, kind, seed=6)
    added = write_checkpoint(bad, kind, seed=6, sharded=damage in ("shard", "truncated"),
                             layers=2 if damage == "unexpected" else 1,
                             tensors=damage != "none", count={"count0": 0, "unexpected": 1}.get(damage))
    if damage in ("nocount", "fraction"):
        config = json.loads((bad / "config.json").read_text())
        config["num_nextn_predict_layers"] = 1.5
        if damage == "nocount":
            del config["num_nextn_predict_layers"]
        (bad / "config.json").write_text(json.dumps(config))
    fresh, holding, loaded = (_load(bad, kind) for _ in range(3))  # before the weight files are damaged
    weights = load_file(str(bad / "model.safetensors")) if damage in ("missing", "shape", "expert") else None
    if damage == "missing":
        del weights["mtp.fc.weight"]
    elif damage == "shape":
        weights["mtp.fc.weight"] = weights["mtp.fc.weight"][:, :64].contiguous()
    elif damage == "expert":
        del weights["mtp.layers.0.mlp.experts.3.down_proj.weight"]
    if weights is not None:
        save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    if damage == "shard":
        (bad / "mtp-1.safetensors").unlink()
    if damage == "truncated":  # a download cut short after the model loaded
        data = (bad / "mtp-0.safetensors").read_bytes()
        (bad / "mtp-0.safetensors").write_bytes(data[:len(data) // 2])
    assert added or damage == "none"

    before = _state(fresh)
    with pytest.raises(ValueError, match=match):
        apply_recoverssm(fresh, mtp=bad)
    assert not is_converted(fresh) and "generate" not in vars(fresh) and _same_state(fresh, before)

    head = load_mtp_head(_load(good, kind))
    apply_recoverssm(holding)._recoverssm.mtp = head
    config = holding._recoverssm.config
    with pytest.raises(ValueError, match=match):
        apply_recoverssm(holding, mtp=bad, cuda_graphs=True)
    assert holding._recoverssm.mtp is head and holding._recoverssm.config == config  # nothing changed

    loaded = apply_recoverssm(loaded)
    with pytest.raises(ValueError, match="use_mtp=True: .*" + match):
        loaded.generate(torch.tensor([TOK.encode("abc")]), max_new_tokens=4, use_mtp=True, num_assistant_tokens=2)
    assert loaded._recoverssm.mtp is None and loaded._recoverssm.loop is None


def test_a_head_read_from_another_checkpoint_takes_its_layer_count_from_there(tmp_path):
    """``apply_recoverssm(model, mtp=PATH)`` on a model whose config declares no MTP layer count:
    the count of the ``config.json`` beside PATH's weights (two layers here), and the head drafts
    exactly; a ``config.json`` there that is not a config is named."""
    write_checkpoint(tmp_path / "two", "qwen3_next", seed=3, layers=2)
    built = tiny_model("qwen3_next", seed=3)
    assert getattr(built.config, "num_nextn_predict_layers", None) is None
    ref = tiny_model("qwen3_next", seed=3)
    (tmp_path / "broken").mkdir()
    for name in ("model.safetensors", "config.json"):
        (tmp_path / "broken" / name).write_bytes((tmp_path / "two" / name).read_bytes())
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken/config\.json cannot be read as a config"):
        apply_recoverssm(built, mtp=tmp_path / "broken")
    assert not is_converted(built)
    model = apply_recoverssm(built, mtp=tmp_path / "two")
    assert model._recoverssm.mtp.num_layers == 2
    texts = ["the cat sat on the mat. the cat", "a b c a b"]
    ids, mask = _batch(texts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=13, do_sample=False, use_mtp=True,
                         num_assistant_tokens=3)
    _check_rows(out, ids.shape[1], _own(ref, texts, 13, "cpu"), TOK.pad_token_id)
    assert acceptance_stats(model).rounds > 0


def test_calls_that_cannot_draft_with_the_head_are_refused(checkpoint, tmp_path):
    """No checkpoint to read (a model built in memory) or no such path; another drafter in the
    same call; the decode loop turned off; an option only transformers' loop implements."""
    path, _ = checkpoint("qwen3_5")
    ids = torch.tensor([TOK.encode("abc")])
    built = tiny_model("qwen3_5", seed=3)
    built.config.mtp_num_hidden_layers = 1
    built = apply_recoverssm(built)
    with pytest.raises(ValueError, match="no checkpoint path"):
        built.generate(ids, max_new_tokens=4, use_mtp=True)
    with pytest.raises(ValueError, match="is not a file or directory"):
        apply_recoverssm(built, mtp=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        apply_recoverssm(built, mtp=tmp_path)
    model = apply_recoverssm(_load(path, "qwen3_5"))
    with pytest.raises(ValueError, match="one drafter per call"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match=r"needs transformers' loop \(output_scores=True\)"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, output_scores=True, return_dict_in_generate=True)
    apply_recoverssm(model, decode_loop=False)
    with pytest.raises(ValueError, match="decode_loop=False"):
        model.generate(ids, max_new_tokens=4, use_mtp=True)


def test_a_copy_of_the_model_carries_its_own_head(checkpoint):
    """``copy.deepcopy`` of a converted model holding a head: the copy drafts with a copy of it."""
    path, _ = checkpoint("qwen3_5")
    model = apply_recoverssm(_load(path, "qwen3_5"), mtp=True)
    twin = copy.deepcopy(model)
    assert twin._recoverssm.mtp is not model._recoverssm.mtp
    assert torch.equal(twin._recoverssm.mtp.fc.weight, model._recoverssm.mtp.fc.weight)
    ids = torch.tensor([TOK.encode(TEXTS[0])])
    a = model.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True, num_assistant_tokens=2)
    assert torch.equal(twin.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True, num_assistant_tokens=2), a)
