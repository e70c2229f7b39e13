"""Train the demo model pair: a byte-level Qwen3.5-shaped target and a small draft, on the
Python standard library's own source.

The main job needs real text and real acceptance, but nothing can be downloaded here; every
machine carries a corpus: the ``.py`` files of the running Python's standard library
(CPython, PSF License Version 2). The split is fixed and written out: test packages and
``test_*.py`` files are left out, and one file in twenty (by a hash of its path) is held out
for the bits-per-byte measurement.

The models are the plain Hugging Face classes (``Qwen3_5ForCausalLM``; no kernels of ours in
training): the target has GDN layers with full attention every fourth layer, as the published
models (about 6 M parameters); the draft has one GDN and one attention layer (Qwen3.5's forward
needs an attention layer for its cache), a narrower MLP and the same byte vocabulary.

    python scripts/train_demo_model.py --out demo_out            # H200: the full run (< 8 min)
    python scripts/train_demo_model.py --smoke --out /tmp/demo   # a few steps at tiny sizes (CPU)

Writes ``OUT/target`` and ``OUT/draft`` (``save_pretrained``, safetensors, bf16), ``OUT/demo.json``
(the command, seed, sizes, the data split, held-out bits per byte of both models, the corpus and
its license, the loss curve) and ``OUT/loss.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ssm_spec.hf.kernels import hf_reference_kernels  # noqa: E402
from ssm_spec.hf.tiny import EOS_TOKEN_ID, tiny_config  # noqa: E402

#: Path parts that mark test code (left out of both splits).
TEST_PARTS = {"test", "tests", "idle_test", "__pycache__", "site-packages"}


def is_build_generated(parts: list[str]) -> bool:
    """Files the build writes (they hold the build's own paths and flags, not library source):
    ``_sysconfigdata*.py`` and anything under ``config-<version>-<platform>/``."""
    return parts[-1].startswith("_sysconfigdata") or any(p.startswith("config-") for p in parts[:-1])

#: The steps timed (from, to) before a time budget (``--minutes``) shortens the run (the first
#: steps compile and tune kernels: left out of the timing).
TIMED_STEPS = (10, 30)

#: One file in ``HELD_OUT_EVERY`` (by the SHA-1 of its path) is held out.
HELD_OUT_EVERY = 20
CORPUS_LICENSE = "Python Software Foundation License Version 2 (the CPython standard library)"

#: Sizes: the target's config overrides of ``tiny_config("qwen3_5")`` and the run's schedule; the
#: draft is the target's first two layers' shape (:func:`draft_sizes`).
FULL = dict(target=dict(hidden_size=256, num_layers=8, linear_num_key_heads=4, linear_num_value_heads=8,
                        linear_head_dim=32, intermediate_size=640, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64),
            steps=3000, batch_size=64, seq_len=512, lr=3e-3, warmup=150, eval_windows=256)
SMOKE = dict(target=dict(hidden_size=32, num_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_head_dim=8, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16),
             steps=6, batch_size=4, seq_len=64, lr=3e-3, warmup=2, eval_windows=4, max_files=24)


def draft_sizes(target: dict) -> dict:
    """The draft's config overrides: the target's widths with a narrower MLP (the pair stays under
    the package's 16 MB), one GDN and one attention layer (Qwen3.5's forward needs an attention
    layer for its cache)."""
    return {**target, "num_layers": 2, "layer_types": ["linear_attention", "full_attention"],
            "intermediate_size": max(8, target["intermediate_size"] * 3 // 5)}


def stdlib_split(root: Path | None = None) -> tuple[list[str], list[str]]:
    """``(train, held_out)``: sorted paths, relative to the standard library's directory, of its
    ``.py`` files without test code or build-generated files (:func:`is_build_generated`); a file
    is held out when the SHA-1 of its relative path is ``0 mod HELD_OUT_EVERY``."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if TEST_PARTS & set(parts) or parts[-1].startswith("test_") or is_build_generated(parts):
            continue
        digest = int(hashlib.sha1(rel.encode()).hexdigest(), 16)
        (held if digest % HELD_OUT_EVERY == 0 else train).append(rel)
    return train, held


def load_bytes(root: Path, files: list[str]) -> torch.Tensor:
    """The files' bytes as token ids ``[N]`` int64, each file followed by ``eos``."""
    chunks = []
    for rel in files:
        data = (root / rel).read_bytes()
        if data:  # an empty file (many __init__.py) is its eos alone
            chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64))
        chunks.append(torch.tensor([EOS_TOKEN_ID]))
    return torch.cat(chunks)


def build(sizes: dict, seed: int):
    """A freshly initialised ``Qwen3_5ForCausalLM`` (the Hugging Face default init), seeded."""
    import transformers

    torch.manual_seed(seed)
    return transformers.Qwen3_5ForCausalLM(tiny_config("qwen3_5", **sizes))


@torch.no_grad()
def bits_per_byte(model, data: torch.Tensor, seq_len: int, windows: int, device, autocast) -> float:
    """Mean next-token cross-entropy over the first ``windows`` non-overlapping windows of
    ``data``, in bits (one token is one byte)."""
    model.eval()
    n = min(windows, (data.numel() - 1) // seq_len)
    total, count = 0.0, 0
    for start in range(0, n, 16):
        idx = torch.arange(start, min(n, start + 16)) * seq_len
        x = torch.stack([data[i:i + seq_len + 1] for i in idx.tolist()]).to(device)
        with autocast():
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1) / math.log(2)


def parse(argv=None):
    """The parsed arguments, checked: a bad value is a one-line usage error (exit status 2) before
    anything is read or trained."""
    description = " ".join(__doc__.split("\n\n")[0].split())
    p = argparse.ArgumentParser(prog="train_demo_model.py", description=description)
    p.add_argument("--out", required=True,
                   help="output directory (created; an earlier run's files there are overwritten)")
    p.add_argument("--smoke", action="store_true", help="a few steps at tiny sizes (runs on CPU in seconds)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps, >= 1 (default: {FULL['steps']}; with --smoke: {SMOKE['steps']})")
    p.add_argument("--minutes", type=float, default=None,
                   help="training time budget: after 20 timed steps the run is shortened to fit it, the cosine "
                        "schedule rescaled to the new length (default: 6 on CUDA, none elsewhere)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default: 0)")
    p.add_argument("--stdlib", default=None, help="the corpus root (default: this Python's standard library)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps: expected >= 1, got {args.steps}")
    if args.minutes is not None and not (args.minutes > 0 and math.isfinite(args.minutes)):
        p.error(f"--minutes: expected a finite number > 0, got {args.minutes}")
    out = Path(args.out).expanduser()
    blocking = next((q for q in (out, *out.parents) if q.exists() and not q.is_dir()), None)
    if blocking is not None:
        p.error(f"--out {args.out}: {blocking} exists and is not a directory")
    existing = next(q for q in (out, *out.parents) if q.exists())
    try:  # a folder that cannot be written fails here, not after the training
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write_check"))
    except OSError as exc:
        p.error(f"--out {args.out}: {existing} is not writable ({exc.strerror or exc})")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            p.error(f"--device {args.device}: not a torch device (expected cpu, cuda or cuda:N)")
        if device.type not in ("cpu", "cuda"):
            p.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: CUDA is not available on this machine")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            p.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA devices")
    if args.stdlib is not None and not Path(args.stdlib).expanduser().is_dir():
        p.error(f"--stdlib {args.stdlib}: no such directory")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    # transformers' own PyTorch GDN functions, not the fla-core kernels it binds where installed:
    # fla-core 0.6 refuses its gated chunk backward on Hopper under Triton < 3.7.1 (wrong results
    # there, fla issue #640), and the same math then trains the pair on any machine.
    with hf_reference_kernels():
        return train(args, sys.argv[1:] if argv is None else argv)


def train(args, argv: list[str]) -> int:
    """The run of :func:`main` (its arguments parsed and checked)."""
    from tqdm import tqdm
    from transformers import get_cosine_schedule_with_warmup

    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["draft"] = draft_sizes(cfg["target"])
    steps = cfg["steps"] if args.steps is None else args.steps
    warmup = min(cfg["warmup"], steps // 2)  # a short --steps run still takes steps at a nonzero rate
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    root = Path(args.stdlib).expanduser() if args.stdlib else Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = stdlib_split(root)
    if cfg.get("max_files"):
        train_files, held_files = train_files[:cfg["max_files"]], held_files[:max(2, cfg["max_files"] // 8)]
    if not train_files or not held_files:
        print(f"train_demo_model.py: error: --stdlib {root}: {len(train_files)} training and {len(held_files)} "
              "held-out .py files (the split needs both)", file=sys.stderr)
        return 2
    train, held = load_bytes(root, train_files), load_bytes(root, held_files)
    for what, data in (("training", train), ("held-out", held)):
        if data.numel() < cfg["seq_len"] + 2:
            print(f"train_demo_model.py: error: --stdlib {root}: the {what} files hold {data.numel()} tokens (bytes "
                  f"and one eos per file), fewer than a window of {cfg['seq_len'] + 2}", file=sys.stderr)
            return 2
    print(f"corpus: {root} ({len(train_files)} training files, {train.numel() / 1e6:.1f} MB; "
          f"{len(held_files)} held out, {held.numel() / 1e6:.2f} MB)")

    models = {"target": build(cfg["target"], args.seed).to(device),
              "draft": build(cfg["draft"], args.seed + 1).to(device)}
    opts, scheds = {}, {}
    for name, m in models.items():
        m.train()
        opts[name] = torch.optim.AdamW(m.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
        scheds[name] = get_cosine_schedule_with_warmup(opts[name], warmup, steps)
    gen = torch.Generator().manual_seed(args.seed)
    B, T = cfg["batch_size"], cfg["seq_len"]
    curve = {"step": [], "target": [], "draft": []}
    t0 = time.time()
    bar = tqdm(range(steps), desc="train", unit="step", disable=None)
    minutes = args.minutes if args.minutes is not None else (6.0 if device.type == "cuda" else None)
    planned, t_timed = steps, None
    for step in bar:
        if step >= steps:
            break
        if minutes is not None and step == TIMED_STEPS[0]:
            t_timed = time.time()
        if minutes is not None and step == TIMED_STEPS[1] < steps:
            per_step = (time.time() - t_timed) / (TIMED_STEPS[1] - TIMED_STEPS[0])
            fits = step + int((minutes * 60 - (time.time() - t0)) / per_step)
            if fits < steps:  # shorten the run; the schedule's remaining cosine is spread over what fits
                steps = max(fits, step + 1)
                warmup = min(warmup, steps // 2)
                for name in models:
                    scheds[name] = get_cosine_schedule_with_warmup(opts[name], warmup, steps, last_epoch=step - 1)
                bar.total = steps
                print(f"time budget {minutes:g} min ({per_step * 1e3:.0f} ms a step): {steps} of {planned} steps",
                      file=sys.stderr)
        starts = torch.randint(0, train.numel() - T - 1, (B,), generator=gen)
        x = torch.stack([train[s:s + T + 1] for s in starts.tolist()]).to(device, non_blocking=True)
        losses = {}
        for name, m in models.items():
            with autocast():
                logits = m(input_ids=x[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1))
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[name].step()
            scheds[name].step()
            losses[name] = float(loss.detach()) / math.log(2)
        if step % max(1, planned // 200) == 0 or step == steps - 1:
            curve["step"].append(step)
            for name in models:
                curve[name].append(losses[name])
            bar.set_postfix(target=f"{losses['target']:.3f}", draft=f"{losses['draft']:.3f}")
    train_s = time.time() - t0
    bpb = {name: bits_per_byte(m, held, T, cfg["eval_windows"], device, autocast) for name, m in models.items()}
    print("held-out bits per byte: " + ", ".join(f"{n} {v:.3f}" for n, v in bpb.items()) + f" ({train_s:.0f} s)")

    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    params = {}
    for name, m in models.items():
        m.to(torch.bfloat16).save_pretrained(out / name, safe_serialization=True)
        params[name] = sum(p.numel() for p in m.parameters())
    manifest = {
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "smoke": args.smoke, "seed": args.seed, "steps": steps, "planned_steps": planned, "minutes": minutes,
        "warmup": warmup, "batch_size": B, "seq_len": T,
        "lr": cfg["lr"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "train_seconds": round(train_s, 1), "parameters": params,
        "held_out_bits_per_byte": bpb, "sizes": {"target": cfg["target"], "draft": cfg["draft"]},
        "corpus": {"source": f"CPython {platform.python_version()} standard library ({root})",
                   "license": CORPUS_LICENSE,
                   "rule": f"*.py without {sorted(TEST_PARTS)}, test_*.py or build-generated files "
                           f"(_sysconfigdata*, config-*/); held out: sha1(relative path) % {HELD_OUT_EVERY} == 0",
                   "train_files": train_files, "held_out_files": held_files},
        "tokenizer": "bytes 0..255, eos 256, pad 257 (ssm_spec.hf.tiny.ByteTokenizer)",
        "loss_curve_bits_per_byte": curve,
    }
    (out / "demo.json").write_text(json.dumps(manifest, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in models:
            ax.plot(curve["step"], curve[name], label=f"{name} (held out {bpb[name]:.2f})")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss, bits per byte")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no loss.png", file=sys.stderr)
    print(f"wrote {out}/target, {out}/draft, {out}/demo.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
