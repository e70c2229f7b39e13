"""Train a multi-token-prediction (MTP) head for the packaged demo target, the target frozen.

The head is :class:`ssm_spec.hf.mtp.MTPHead` built for the target (``MTPHead.for_model``: one
full-attention decoder layer of the target's class, its norms, ``fc``), under the names the
published Qwen3.5 checkpoints use (``mtp.*``) and that :func:`ssm_spec.hf.mtp.load_mtp_head`
reads. It is trained on what the drafter feeds it at inference (``ssm_spec/hf/mtp/head.py``):
the target's hidden state ``h[t]`` after its final norm and the embedding of token ``t + 1`` at
position ``t`` predict token ``t + 2`` through the target's own (frozen) LM head. Draft steps
after the first feed the head's own output back with the next token, one position further on;
training unrolls ``unroll`` such steps with the attention the drafter's KV cache gives them: a
step-``s`` query of the chain anchored at ``t`` sees the true pairs at positions ``<= t`` and
its own chain's earlier steps. The loss is the cross-entropy against the target's own next-token
distribution at each predicted position (distillation: acceptance is agreement with the target).

Data: ``scripts/train_demo_model.py``'s split of the standard library's source (its
``stdlib_split`` and ``load_bytes``); the held-out files are only for the evaluation below.

Evaluation (what acceptance measures): greedy continuations of held-out prompts by the target;
over them, from every anchor in the generated text, the head drafts 5 tokens recursively (each
step fed its own draft, which on a greedy sequence is the sequence's token wherever the earlier
drafts were accepted) and each draft is compared with the target's greedy token. Reported per
draft position ``j``: the share of anchors whose drafts ``1 .. j`` all match (what the decode
loop's per-position acceptance counts), the top-1 agreement at ``j`` given ``1 .. j - 1``
matched, and the expected tokens per round ``1 + sum of the first k rates`` for ``k = 1 .. 5``.

    python scripts/train_demo_mtp.py --out mtp_out                  # H200: the full run (~3 min)
    python scripts/train_demo_mtp.py --smoke --out /tmp/mtp --device cpu  # a few steps (seconds)
    python scripts/train_demo_mtp.py --install mtp_out              # into ssm_spec/assets/demo

A training run writes ``OUT`` as a demo directory (``SSM_SPEC_DEMO_DIR=OUT`` or
``--model OUT/target`` use it): ``OUT/target`` the target's files with the ``mtp.*`` tensors
(bf16) added to its ``model.safetensors`` (its own tensors byte for byte) and
``mtp_num_hidden_layers: 1`` in ``config.json``; the draft and ``demo.json`` beside the target
copied; ``OUT/mtp.json`` the training record. It never writes the package's assets: ``--install
OUT`` does, as a separate step (``--into DIR`` elsewhere), after checking that the head was
trained on the very target found there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(SCRIPTS))

import train_demo_model as tdm  # noqa: E402  (the data split and loading helpers)

from ssm_spec.hf.kernels import hf_reference_kernels  # noqa: E402

#: The packaged demo directory: where ``--install`` writes by default.
ASSETS_DEMO = ROOT / "ssm_spec" / "assets" / "demo"
WEIGHTS = "model.safetensors"
RECORD = "mtp.json"
#: Draft positions the evaluation reports (the benchmark's k = 1 .. 5).
POSITIONS = 5

#: The run's schedule and sizes. ``eval_*``: held-out prompts, their length and the greedy
#: tokens generated from each.
FULL = dict(steps=2500, batch_size=64, seq_len=512, lr=2e-3, warmup=100, unroll=3, eval_prompts=64,
            eval_prompt_tokens=128, eval_new_tokens=256)
SMOKE = dict(steps=4, batch_size=2, seq_len=48, lr=3e-3, warmup=1, unroll=2, eval_prompts=2, eval_prompt_tokens=16,
             eval_new_tokens=24, max_files=24)


# ----------------------------------------------------------------------------------------- the unrolled head
class StepKV:
    """The keys and values of the head's attention over an unrolled run: each application's
    appended after the earlier ones' (what the layer calls as its cache:
    ``update(keys, values, layer_idx, ...)`` returns every key and value so far, ``[B, kv_heads,
    S, head_dim]``)."""

    def __init__(self):
        self.keys, self.values = [], []

    def update(self, key_states, value_states, layer_idx=0, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        return torch.cat(self.keys, dim=-2), torch.cat(self.values, dim=-2)


def step_mask(n: int, step: int, device, sdpa: bool) -> torch.Tensor:
    """The attention mask of draft step ``step`` (1-based) of ``n`` chains (chain ``t`` anchored at
    position ``t``) over the keys of steps ``1 .. step`` (``n`` each, in that order): the true pairs
    of step 1 at positions ``<= t``, and chain ``t``'s own steps ``2 .. step``, as the drafter's
    KV cache holds them when it drafts token ``step`` of a round. ``[1, 1, n, step * n]``: bool for
    sdpa, else additive float32."""
    t = torch.arange(n, device=device)
    blocks = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * (step - 1)
    allowed = torch.cat(blocks, dim=1)[None, None]
    if sdpa:
        return allowed
    return torch.zeros((), device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def unrolled(head, target, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head applied ``steps`` times, recursively, to the ``N = L - steps`` chains of a sequence.

    Args:
        head: an :class:`~ssm_spec.hf.mtp.MTPHead` of one layer.
        target: the target (its embeddings, rotary embedding and attention implementation).
        hidden: ``[B, L, H]`` the target's hidden states after its final norm.
        tokens: ``[B, L]`` int64, the sequence the hidden states are of.
        steps: draft steps ``D >= 1``.

    Returns:
        ``D`` tensors ``[B, N, H]``: step ``s``'s output for chain ``t`` is the head over
        ``(h[t], x[t + 1])`` at position ``t`` (``s = 1``) or over (step ``s - 1``'s output,
        ``x[t + s]``) at position ``t + s - 1``; ``lm_head`` of it predicts ``x[t + s + 1]``.

    Raises:
        ValueError: ``steps`` not in ``1 .. L - 1``.
    """
    from ssm_spec.hf.mtp import text_decoder

    B, L = tokens.shape
    if not 1 <= steps < L:
        raise ValueError(f"unrolled: steps={steps} for a sequence of {L} tokens; expected 1 .. {L - 1}")
    n = L - steps
    rotary = text_decoder(target).rotary_emb
    sdpa = (getattr(target.config, "_attn_implementation", None) or "eager") == "sdpa"
    embed = target.get_input_embeddings()
    cache, outs, g = StepKV(), [], hidden[:, :n]
    for s in range(1, steps + 1):
        pos = torch.arange(s - 1, s - 1 + n, device=tokens.device)[None].expand(B, n)
        rope = rotary(g, pos[None].expand(3, B, n) if hasattr(rotary, "mrope_section") else pos)
        g = head(embed(tokens[:, s:s + n]), g, rope, step_mask(n, s, tokens.device, sdpa), pos, cache, step=s - 1)
        outs.append(g)
    return outs


def target_pass(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [B, L, H], logits [B, L, V] float32)`` of the frozen target over ``x [B, L]``: its
    decoder's output after the final norm (what the drafter is fed) and its LM head on it."""
    from ssm_spec.hf.mtp import text_decoder

    with torch.no_grad():
        hidden = text_decoder(target)(input_ids=x, use_cache=False).last_hidden_state
        return hidden, target.get_output_embeddings()(hidden).float()


# ----------------------------------------------------------------------------------------- evaluation
def greedy_rollouts(target, prompts: torch.Tensor, new_tokens: int, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequences [n, P + G], lengths [n])``: the target's greedy continuation of ``prompts [n, P]``
    by ``generate``; a row that emits its end-of-sequence token stops there (its length counts it,
    the rest is padding)."""
    gen = target.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else tdm.EOS_TOKEN_ID
    with torch.no_grad(), autocast():
        seq = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=pad, temperature=None, top_p=None, top_k=None)
    P = prompts.shape[1]
    eos = torch.as_tensor(gen.eos_token_id if gen.eos_token_id is not None else [], device=seq.device).reshape(-1)
    new = seq[:, P:]
    stop = torch.isin(new, eos) if eos.numel() else torch.zeros_like(new, dtype=torch.bool)
    first = torch.where(stop.any(1), stop.float().argmax(1) + 1, torch.full_like(stop[:, 0], new.shape[1],
                                                                                  dtype=torch.int64))
    return seq, P + first


def evaluate(head, target, prompts: torch.Tensor, new_tokens: int, autocast, positions: int = POSITIONS) -> dict:
    """Acceptance of the head's recursive drafts against the target's greedy tokens on the target's
    own greedy continuations of ``prompts [n, P]`` (module docstring).

    Returns ``{"anchors", "position_rates", "conditional_top1", "expected_tokens_per_round",
    "rollout_tokens", "rollout_mismatches"}``: ``position_rates[j - 1]`` the share of anchors
    whose drafts ``1 .. j`` all equal the target's greedy tokens; ``conditional_top1[j - 1]``
    draft ``j``'s agreement where ``1 .. j - 1`` matched; ``expected_tokens_per_round[k - 1] =
    1 + sum(position_rates[:k])``. ``rollout_mismatches`` counts generated tokens that the
    forward used here ranks otherwise (bf16 near-ties between the generate and the full-sequence
    forward); a chain that feeds such a token is left out.
    """
    seq, lengths = greedy_rollouts(target, prompts, new_tokens, autocast)
    P, D = prompts.shape[1], positions
    with autocast():
        hidden, logits = target_pass(target, seq)
        with torch.no_grad():
            outs = unrolled(head, target, hidden, seq, D)
            lm_head = target.get_output_embeddings()
            drafts = torch.stack([lm_head(g).argmax(-1) for g in outs], dim=-1)  # [n, N, D]
    ref = logits.argmax(-1)  # ref[c]: the target's greedy token after position c
    n_rows, L = seq.shape
    N = L - D
    c = torch.arange(L, device=seq.device)
    real = c[None] < lengths[:, None]  # tokens of the row (prompt, generated, the stopping eos)
    consistent = torch.ones_like(real)
    consistent[:, :-1] = (seq[:, 1:] == ref[:, :-1]) | ~real[:, 1:]  # seq[c + 1] is the greedy token after c
    consistent[:, :P - 1] = True  # the prompt's tokens are not the target's
    mismatches = int((~consistent[:, P - 1:]).sum())
    t = torch.arange(N, device=seq.device)
    # chain t: fed x[t + 1 .. t + D] (the last drafted tokens x[t + 2 ..] must be greedy ones), all real
    ok = (t[None] + 1 >= P) & (t[None] + D < lengths[:, None])
    for s in range(1, D):
        ok &= consistent[:, t + s]
    targets = torch.stack([ref[:, t + s] for s in range(1, D + 1)], dim=-1)  # [n, N, D]
    match = (drafts == targets)[ok]  # [anchors, D]
    anchors = int(match.shape[0])
    prefix = match.long().cumprod(dim=1).bool()
    rates = prefix.float().mean(0).tolist() if anchors else [0.0] * D
    cond = []
    for j in range(D):
        given = prefix[:, j - 1] if j else torch.ones(anchors, dtype=torch.bool, device=match.device)
        cond.append(float(match[given, j].float().mean()) if given.any() else 0.0)
    return {"anchors": anchors, "position_rates": rates, "conditional_top1": cond,
            "expected_tokens_per_round": [1.0 + sum(rates[:k]) for k in range(1, D + 1)],
            "rollout_tokens": int((lengths - P).sum()), "rollout_mismatches": mismatches}


def eval_prompts(held: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``[count, length]`` prompts: windows of the held-out tokens at evenly spaced starts."""
    last = held.numel() - length
    starts = torch.linspace(0, max(last, 0), count).long().tolist()
    return torch.stack([held[s:s + length] for s in starts])


# ----------------------------------------------------------------------------------------- writing
def mtp_state(head) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names (``mtp.`` + the head's own), bf16 on the CPU."""
    return {f"mtp.{name}": t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in head.state_dict().items()}


def write_config(path: Path, layers: int) -> None:
    """Set ``mtp_num_hidden_layers`` in the ``config.json`` at ``path`` (written as transformers
    writes it: sorted keys, indent 2)."""
    cfg = json.loads(path.read_text())
    cfg["mtp_num_hidden_layers"] = int(layers)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def merged_weights(target_file: Path, mtp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``target_file`` without any earlier ``mtp.*``, with ``mtp`` added."""
    from safetensors.torch import load_file

    own = {n: t for n, t in load_file(str(target_file)).items() if not n.startswith("mtp.")}
    return {**own, **mtp}


def write_out(out: Path, target_dir: Path, mtp: dict[str, torch.Tensor], record: dict) -> None:
    """``out`` as a demo directory: ``target/`` (the target's files, its weights with ``mtp``
    added, its config declaring one MTP layer), the draft and ``demo.json`` beside the target
    copied where they exist, and ``mtp.json`` (``record``)."""
    from safetensors.torch import save_file

    dst = out / "target"
    dst.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if f.is_file() and f.name != WEIGHTS:
            shutil.copy2(f, dst / f.name)
    save_file(merged_weights(target_dir / WEIGHTS, mtp), str(dst / WEIGHTS), metadata={"format": "pt"})
    write_config(dst / "config.json", 1)
    if (target_dir.parent / "draft").is_dir() and (out / "draft").resolve() != (target_dir.parent / "draft").resolve():
        shutil.copytree(target_dir.parent / "draft", out / "draft", dirs_exist_ok=True)
    if (target_dir.parent / "demo.json").is_file():
        shutil.copy2(target_dir.parent / "demo.json", out / "demo.json")
    (out / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def check_loads(target_dir: Path) -> str:
    """Load ``target_dir`` with transformers (which ignores ``mtp.*``) and its head with
    :func:`~ssm_spec.hf.mtp.load_mtp_head`; a line saying so.

    Raises:
        ValueError: the head does not load (names, shapes, the layer count).
    """
    import transformers

    from ssm_spec.hf.mtp import load_mtp_head

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    head = load_mtp_head(model)
    return (f"{target_dir} loads: transformers ignores its mtp.* tensors, load_mtp_head reads a {head.num_layers}-layer "
            f"head of {sum(p.numel() for p in head.parameters())} parameters")


def install(src: Path, into: Path) -> str:
    """Put the head a training run wrote in ``src`` into the demo directory ``into``: its ``mtp.*``
    tensors into ``into/target/model.safetensors`` (beside the target's own, which stay as they
    are), ``mtp_num_hidden_layers`` into its ``config.json``, ``src/mtp.json`` beside.

    Returns a line saying what was written.

    Raises:
        ValueError: ``src`` is not a training run's output (no ``target/model.safetensors`` with
            ``mtp.*`` tensors, no ``mtp.json``), ``into`` holds no target, or its target's
            tensors differ from those the head was trained on (names, shapes or values).
    """
    from safetensors.torch import load_file, save_file

    weights, record = src / "target" / WEIGHTS, src / RECORD
    if not weights.is_file() or not record.is_file():
        raise ValueError(f"--install {src}: not a training run's output (needs target/{WEIGHTS} and {RECORD})")
    dst = into / "target" / WEIGHTS
    if not dst.is_file():
        raise ValueError(f"--into {into}: no target/{WEIGHTS} there")
    trained = load_file(str(weights))
    mtp = {n: t for n, t in trained.items() if n.startswith("mtp.")}
    if not mtp:
        raise ValueError(f"--install {src}: target/{WEIGHTS} holds no mtp.* tensors")
    own = {n: t for n, t in load_file(str(dst)).items() if not n.startswith("mtp.")}
    base = {n: t for n, t in trained.items() if not n.startswith("mtp.")}
    differ = sorted(set(own) ^ set(base)) or [n for n in own if own[n].dtype != base[n].dtype
                                              or own[n].shape != base[n].shape or not torch.equal(own[n], base[n])]
    if differ:
        raise ValueError(f"--install {src}: the head was trained on another target than {into / 'target'} "
                         f"({len(differ)} tensors differ, e.g. {differ[0]}): train it on this one")
    layers = json.loads((src / "target" / "config.json").read_text()).get("mtp_num_hidden_layers", 1)
    save_file({**own, **mtp}, str(dst), metadata={"format": "pt"})
    write_config(into / "target" / "config.json", layers)
    shutil.copy2(record, into / RECORD)
    return f"installed {len(mtp)} mtp.* tensors into {dst}, mtp_num_hidden_layers={layers}, {into / RECORD}"


# ----------------------------------------------------------------------------------------- the run
def parse(argv=None):
    """The parsed arguments, checked: a bad value is a one-line usage error (exit status 2) before
    anything is read or trained."""
    description = " ".join(__doc__.split("\n\n")[0].split())
    p = argparse.ArgumentParser(prog="train_demo_mtp.py", description=description)
    p.add_argument("--out", default=None, help="output directory of a training run (created; earlier files overwritten)")
    p.add_argument("--install", default=None, metavar="OUT",
                   help="no training: put the head of the training run in OUT into the demo directory (--into)")
    p.add_argument("--into", default=str(ASSETS_DEMO),
                   help=f"with --install: the demo directory to write (default: the package's, {ASSETS_DEMO})")
    p.add_argument("--target", default=None,
                   help="the target checkpoint directory (default: the packaged demo target, "
                        "ssm_spec/assets/demo/target)")
    p.add_argument("--smoke", action="store_true", help="a few steps at tiny sizes (runs on CPU in seconds)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps, >= 1 (default: {FULL['steps']}; with --smoke: {SMOKE['steps']})")
    p.add_argument("--minutes", type=float, default=None,
                   help="training time budget: after 20 timed steps the run is shortened to fit it, the cosine "
                        "schedule rescaled (default: 2.5 on CUDA, none elsewhere)")
    p.add_argument("--unroll", type=int, default=None,
                   help=f"draft steps trained, >= 1 (default: {FULL['unroll']}; with --smoke: {SMOKE['unroll']})")
    p.add_argument("--seed", type=int, default=0, help="seed of the head's weights and the batches (default: 0)")
    p.add_argument("--stdlib", default=None, help="the corpus root (default: this Python's standard library)")
    args = p.parse_args(argv)
    if (args.out is None) == (args.install is None):
        p.error("pass --out DIR (train) or --install OUT (install a training run's head), one of them")
    if args.install is not None:
        return args
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps: expected >= 1, got {args.steps}")
    if args.unroll is not None and not 1 <= args.unroll <= 8:
        p.error(f"--unroll: expected 1 .. 8, got {args.unroll}")
    if args.minutes is not None and not (args.minutes > 0 and math.isfinite(args.minutes)):
        p.error(f"--minutes: expected a finite number > 0, got {args.minutes}")
    out = Path(args.out).expanduser()
    blocking = next((q for q in (out, *out.parents) if q.exists() and not q.is_dir()), None)
    if blocking is not None:
        p.error(f"--out {args.out}: {blocking} exists and is not a directory")
    if (out / "target").resolve() == ASSETS_DEMO.resolve() / "target" or out.resolve() == ASSETS_DEMO.resolve():
        p.error(f"--out {args.out}: the package's demo directory; write elsewhere and --install from there")
    existing = next(q for q in (out, *out.parents) if q.exists())
    try:  # a folder that cannot be written fails here, not after the training
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write_check"))
    except OSError as exc:
        p.error(f"--out {args.out}: {existing} is not writable ({exc.strerror or exc})")
    target = Path(args.target).expanduser() if args.target else None
    if target is None:
        from ssm_spec.assets import demo_checkpoint

        try:
            target = demo_checkpoint("target")
        except FileNotFoundError as exc:
            p.error(f"--target: {exc}")
    if not (target / "config.json").is_file() or not (target / WEIGHTS).is_file():
        p.error(f"--target {target}: needs config.json and a single {WEIGHTS}")
    args.target = target
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            p.error(f"--device {args.device}: not a torch device (expected cpu, cuda or cuda:N)")
        if device.type not in ("cpu", "cuda"):
            p.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: CUDA is not available on this machine")
    if args.stdlib is not None and not Path(args.stdlib).expanduser().is_dir():
        p.error(f"--stdlib {args.stdlib}: no such directory")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.install is not None:
        try:
            print(install(Path(args.install).expanduser(), Path(args.into).expanduser()))
        except ValueError as exc:
            print(f"train_demo_mtp.py: error: {exc}", file=sys.stderr)
            return 2
        return 0
    with hf_reference_kernels():  # the target's GDN layers on transformers' PyTorch functions, as in its training
        return train(args, sys.argv[1:] if argv is None else argv)


def build_head(target, seed: int):
    """A fresh one-layer :class:`~ssm_spec.hf.mtp.MTPHead` for ``target``, initialised as the
    target's own modules are (its ``_init_weights``: normal linear weights, Gemma norms at 0), fp32,
    on the target's device."""
    from ssm_spec.hf.mtp import MTPHead

    torch.manual_seed(seed)
    head = MTPHead.for_model(target, num_layers=1, device="cpu")
    head.apply(target._init_weights)
    return head.to(target.get_input_embeddings().weight.device).float().train()


def train(args, argv: list[str]) -> int:
    """The training run of :func:`main` (its arguments parsed and checked)."""
    import transformers
    from tqdm import tqdm
    from transformers import get_cosine_schedule_with_warmup

    cfg = dict(SMOKE if args.smoke else FULL)
    steps = cfg["steps"] if args.steps is None else args.steps
    unroll = cfg["unroll"] if args.unroll is None else args.unroll
    warmup = min(cfg["warmup"], steps // 2)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    root = Path(args.stdlib).expanduser() if args.stdlib else Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = tdm.stdlib_split(root)
    if cfg.get("max_files"):
        train_files, held_files = train_files[:cfg["max_files"]], held_files[:max(2, cfg["max_files"] // 8)]
    B, T = cfg["batch_size"], cfg["seq_len"]
    need = cfg["eval_prompt_tokens"] + 1
    if not train_files or not held_files:
        print(f"train_demo_mtp.py: error: --stdlib {root}: {len(train_files)} training and {len(held_files)} "
              "held-out .py files (the split needs both)", file=sys.stderr)
        return 2
    data, held = tdm.load_bytes(root, train_files), tdm.load_bytes(root, held_files)
    if data.numel() < T + 2 or held.numel() < need:
        print(f"train_demo_mtp.py: error: --stdlib {root}: {data.numel()} training and {held.numel()} held-out "
              f"tokens, fewer than a window ({T + 2}) or a prompt ({need})", file=sys.stderr)
        return 2
    print(f"corpus: {root} ({len(train_files)} training files, {data.numel() / 1e6:.1f} MB; "
          f"{len(held_files)} held out)")

    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    target.requires_grad_(False)
    head = build_head(target, args.seed)
    lm_head = target.get_output_embeddings()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_cosine_schedule_with_warmup(opt, warmup, steps)
    gen = torch.Generator().manual_seed(args.seed)
    curve = {"step": [], "loss": [], "top1_step1": []}
    minutes = args.minutes if args.minutes is not None else (2.5 if device.type == "cuda" else None)
    planned, t_timed = steps, None
    t0 = time.time()
    bar = tqdm(range(steps), desc="train mtp", unit="step", disable=None)
    for step in bar:
        if step >= steps:
            break
        if minutes is not None and step == tdm.TIMED_STEPS[0]:
            t_timed = time.time()
        if minutes is not None and step == tdm.TIMED_STEPS[1] < steps:
            per_step = (time.time() - t_timed) / (tdm.TIMED_STEPS[1] - tdm.TIMED_STEPS[0])
            fits = step + int((minutes * 60 - (time.time() - t0)) / per_step)
            if fits < steps:
                steps = max(fits, step + 1)
                warmup = min(warmup, steps // 2)
                sched = get_cosine_schedule_with_warmup(opt, warmup, steps, last_epoch=step - 1)
                bar.total = steps
                print(f"time budget {minutes:g} min ({per_step * 1e3:.0f} ms a step): {steps} of {planned} steps",
                      file=sys.stderr)
        starts = torch.randint(0, data.numel() - T - 1, (B,), generator=gen)
        x = torch.stack([data[s:s + T] for s in starts.tolist()]).to(device, non_blocking=True)
        with autocast():
            hidden, logits = target_pass(target, x)
            outs = unrolled(head, target, hidden, x, unroll)
            n = T - unroll
            losses = []
            for s, g in enumerate(outs, start=1):
                teacher = torch.softmax(logits[:, s:s + n], dim=-1)  # the target's distribution of x[t + s + 1]
                pred = torch.log_softmax(lm_head(g).float(), dim=-1)
                losses.append(-(teacher * pred).sum(-1).mean())
                if s == 1:
                    top1 = float((pred.argmax(-1) == teacher.argmax(-1)).float().mean())
            loss = torch.stack(losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, planned // 200) == 0 or step == steps - 1:
            curve["step"].append(step)
            curve["loss"].append(float(loss.detach()))
            curve["top1_step1"].append(top1)
            bar.set_postfix(loss=f"{curve['loss'][-1]:.3f}", top1=f"{top1:.3f}")
    train_s = time.time() - t0

    head.eval()
    with torch.no_grad():  # evaluate what ships: the weights rounded to bf16
        for prm in head.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
    prompts = eval_prompts(held, cfg["eval_prompts"], cfg["eval_prompt_tokens"]).to(device)
    held_out = evaluate(head, target, prompts, cfg["eval_new_tokens"], autocast)
    held_out.update(prompts=int(prompts.shape[0]), prompt_tokens=int(prompts.shape[1]),
                    new_tokens=cfg["eval_new_tokens"])
    print("held-out acceptance by draft position: " + " ".join(f"{r:.3f}" for r in held_out["position_rates"])
          + "; expected tokens per round, k = 1..5: "
          + " ".join(f"{v:.2f}" for v in held_out["expected_tokens_per_round"])
          + f" ({held_out['anchors']} anchors, {train_s:.0f} s)")

    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    mtp = mtp_state(head)
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "target": recorded_path(args.target), "smoke": args.smoke, "seed": args.seed, "steps": steps,
        "planned_steps": planned, "minutes": minutes, "warmup": warmup, "batch_size": B, "seq_len": T,
        "unroll": unroll, "lr": cfg["lr"], "loss": "cross-entropy against the target's next-token distribution",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "train_seconds": round(train_s, 1),
        "parameters": sum(t.numel() for t in mtp.values()), "tensors": sorted(mtp),
        "held_out": held_out,
        "corpus": {"rule": "scripts/train_demo_model.py's split (stdlib_split): training files for the batches, "
                           "held-out files for the prompts", "train_files": len(train_files),
                   "held_out_files": len(held_files)},
        "loss_curve": curve,
    }
    write_out(out, Path(args.target), mtp, record)
    print(check_loads(out / "target"))
    print(f"wrote {out}/target (mtp.* beside the target's tensors), {out}/{RECORD}; install with "
          f"'python scripts/train_demo_mtp.py --install {out}'")
    return 0


def recorded_path(path) -> str:
    """``path`` relative to the repository when it lies inside (no machine's absolute paths in
    a committed record), else as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
