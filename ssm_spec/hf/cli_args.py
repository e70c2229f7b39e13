"""``ssm-spec generate``'s options and the checks of them that need no model.

This module imports neither torch nor transformers, nor another module of the package, at
import time: building the parser, printing ``--help``, naming the demo pair
(:func:`resolve_names`), the option values (:func:`check_values`) and the checkpoint
directories (:func:`checkpoint_dir`) all run on the standard library alone. (The packages
above it, ``ssm_spec`` and ``ssm_spec.hf``, import torch in their ``__init__`` except in the
``ssm-spec`` command itself: :mod:`ssm_spec._lazy`.) The checks that need torch or
transformers (the device, a checkpoint's config) are in :mod:`ssm_spec.hf.cli_loading`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

__all__ = ["DEFAULT_PROMPT", "DRAFT_KEYWORDS", "DTYPE_NAMES", "TINY_KIND", "CLIError", "add_arguments",
           "check_values", "checkpoint_dir", "error_line", "note", "resolve_names"]

#: The default prompt: the start of a small class, whose continuation (more methods of the same
#: shape) the demo model writes and prompt lookup can copy from.
DEFAULT_PROMPT = ("class Stack:\n"
                  '    """A last-in, first-out stack."""\n'
                  "\n"
                  "    def __init__(self):\n"
                  "        self._items = []\n"
                  "\n"
                  "    def push(self, item):\n"
                  '        """Push *item* onto the stack."""\n'
                  "        self._items.append(item)\n"
                  "\n"
                  "    def pop(self):\n"
                  '        """Remove and return the top item."""\n'
                  "        return self._items.pop()\n"
                  "\n")
TINY_KIND = "qwen3_next"
#: ``--dtype``'s values: names of torch dtypes (``cli_loading.DTYPES`` maps them to the dtypes).
DTYPE_NAMES = ("bfloat16", "float32")
DRAFT_KEYWORDS = ("prompt-lookup", "self", "mtp")


class CLIError(Exception):
    """A user-facing error: its message goes to stderr and the command exits with status 2."""


def error_line(exc: Exception) -> str:
    """``ssm-spec generate: error: ...``: the message of ``exc`` on one line, whatever its text
    (a cause's, say) held."""
    return "ssm-spec generate: error: " + re.sub(r"\s*\n\s*", " ", str(exc).strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` options to ``parser`` (an argparse subparser)."""
    parser.add_argument("--model", metavar="tiny-random|demo|PATH", default=None,
                        help="'demo' (the default: the packaged byte-level Qwen3.5-shaped model trained on the "
                             "Python standard library's source; SSM_SPEC_DEMO_DIR=DIR looks it up in a training "
                             "run's --out DIR instead), a local Qwen3-Next / Qwen3.5 checkpoint directory, or "
                             f"'tiny-random' (the embedded tiny {TINY_KIND} model with random weights and a byte "
                             "tokenizer: fast, its text random bytes)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT,
                        help="the prompt (default: the start of a small Python class)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="tokens to generate (256)")
    parser.add_argument("--draft", default="prompt-lookup", metavar="prompt-lookup|self|mtp|demo|PATH",
                        help="where drafts come from: prompt lookup (default), 'self' (the model drafts for "
                             "itself: every draft is accepted), 'mtp' (the checkpoint's own multi-token-prediction "
                             "head, its mtp.* weights: generate(use_mtp=True) in ssm-spec's decode loop), 'demo' "
                             "(the packaged demo draft), or a local causal LM checkpoint used as the assistant model "
                             "(converted with apply_recoverssm when it has GDN layers)")
    parser.add_argument("--num-draft-tokens", type=int, default=5, metavar="K",
                        help="drafts per round: prompt_lookup_num_tokens, or the assistant's or MTP head's "
                             "num_assistant_tokens (5)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0, metavar="P",
                        help="the assistant's assistant_confidence_threshold: where a call runs transformers' own loop "
                             "it stops drafting early when the assistant's top probability drops below P; "
                             "ssm-spec's decode loop always drafts K tokens (default 0; transformers' own default "
                             "is 0.4)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                        help="replay the model's forwards after the prompt as CUDA graphs "
                             "(apply_recoverssm(cuda_graphs=True)); auto: on a CUDA device (default)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch's intra-op threads (torch.set_num_threads). Default: 1 on a CPU device unless "
                             "OMP_NUM_THREADS is set: the tiny and demo models' matmuls are too small to share (on a "
                             "2-core machine one thread measured as fast as two when idle, and 2.6-4x faster with one "
                             "core taken by another job, as threads that wait for a busy core wait for each other); "
                             "torch's own default on CUDA. Raise it for a large checkpoint on a free many-core CPU")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32",
                        help="model dtype (float32, the default, gives exactly plain greedy's tokens; it also "
                             "keeps TF32 out of cuBLAS, cuDNN and Triton dots unless TRITON_F32_DEFAULT is set)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the tiny model's weights and of sampling (0)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (with --do-sample)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="timed generate calls per run (plain transformers, converted without drafts, "
                             "converted with drafts); each run reports their median (3)")
    parser.add_argument("--warmup", type=int, default=16, metavar="N",
                        help="new tokens of an untimed warm-up call before each timed run (kernel compiles, "
                             "allocator; with CUDA graphs the warm-up sizes its kept cache for the timed run, so "
                             "the graphs it captures are replayed there); 0 skips it (16)")
    parser.add_argument("--check", action="store_true",
                        help="report whether the drafted run's tokens equal plain transformers' greedy "
                             "tokens (the unconverted model's; exit status 1 if not); needs greedy decoding")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars or notes on stderr (the text and the table still print); the bars "
                             "show only where stderr is a terminal in any case")


def note(args, message: str) -> None:
    """Print ``note: message`` to stderr unless ``args.quiet``."""
    if not args.quiet:
        print(f"note: {message}", file=sys.stderr)


def resolve_names(args) -> None:
    """Replace the named checkpoints by what they stand for: ``--model tiny-random`` by the
    embedded tiny model (``None``), ``--model demo`` / ``--draft demo`` by the packaged demo
    pair's directories (:mod:`ssm_spec.assets`); no ``--model`` by the demo target where this
    build carries it, else (with a note) the tiny model. Sets ``args.demo_model``.

    Raises:
        CLIError: ``demo`` asked for (by name, or as the default while ``$SSM_SPEC_DEMO_DIR`` is
            set) and not in this build (or ``$SSM_SPEC_DEMO_DIR``).
    """
    from ..assets import demo_available, demo_checkpoint, demo_dir

    def demo(name, option):
        try:
            return str(demo_checkpoint(name))
        except FileNotFoundError as exc:
            raise CLIError(f"{option} demo: {exc}") from None

    if args.draft == "demo":  # first: a missing demo draft is the one line said
        args.draft = demo("draft", "--draft")
    args.demo_model = args.model == "demo"
    if args.model is None:  # the default: the demo pair's target, where this build carries it
        if demo_available("target"):
            args.model, args.demo_model = str(demo_checkpoint("target")), True
        elif os.environ.get("SSM_SPEC_DEMO_DIR"):  # asked for a pair elsewhere: never a silent swap
            args.model = demo("target", "--model")
        else:
            note(args, f"this build has no demo model ({demo_dir()}): running the tiny random model "
                       "(--model tiny-random)")
    elif args.model == "tiny-random":
        args.model = None
    elif args.model == "demo":
        args.model = demo("target", "--model")


def check_values(args) -> None:
    """Check the option values of parsed ``args`` and the options that exclude each other.

    Raises:
        CLIError: a count out of range (``--max-new-tokens``, ``--num-draft-tokens``,
            ``--repeats``, ``--threads`` below 1, ``--warmup`` below 0), a ``--confidence-threshold`` outside
            [0, 1], a ``--temperature`` without ``--do-sample`` or not above 0, or ``--check``
            with ``--do-sample``.
    """
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.num_draft_tokens < 1:
        raise CLIError(f"--num-draft-tokens: expected >= 1, got {args.num_draft_tokens}")
    if args.repeats < 1:
        raise CLIError(f"--repeats: expected >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads: expected >= 1, got {args.threads}")
    if args.warmup < 0:
        raise CLIError(f"--warmup: expected >= 0, got {args.warmup}")
    if not 0.0 <= args.confidence_threshold <= 1.0:
        raise CLIError(f"--confidence-threshold: expected a probability in [0, 1], got {args.confidence_threshold}")
    if args.temperature is not None and not args.do_sample:
        raise CLIError("--temperature needs --do-sample (greedy decoding has no temperature)")
    if args.temperature is not None and args.temperature <= 0:
        raise CLIError(f"--temperature: expected > 0, got {args.temperature}")
    if args.check and args.do_sample:
        raise CLIError("--check compares with plain greedy decoding and needs greedy decoding: drop --do-sample "
                       "(or --check)")


def checkpoint_dir(path: str, option: str) -> Path:
    """The directory ``path`` given to ``option`` (``--model`` or ``--draft``), checked to look
    like a saved transformers model: a directory with a ``config.json`` and weights
    (``*.safetensors`` or ``*.bin``). Reads no file.

    Returns the path, ``~`` expanded.

    Raises:
        CLIError: an empty path, no such directory, not a directory, a demo training run's
            output (``demo.json``, no ``config.json``: the message names its member), no
            ``config.json``, or no weights.
    """
    if not str(path).strip():
        expected = ("prompt-lookup, self, mtp, demo, or a local checkpoint directory" if option == "--draft"
                    else "tiny-random, demo, or a local checkpoint directory")
        raise CLIError(f"{option}: empty (expected {expected})")
    p = Path(path).expanduser()
    if not p.exists():
        expected = ("prompt-lookup, self, mtp, demo, or a local checkpoint directory" if option == "--draft"
                    else "tiny-random, demo, or a local checkpoint directory; nothing is downloaded")
        raise CLIError(f"{option} {path}: no such directory (expected {expected})")
    if not p.is_dir():
        raise CLIError(f"{option} {path}: not a directory (expected a local checkpoint directory)")
    if not (p / "config.json").is_file() and (p / "demo.json").is_file():
        member = "draft" if option == "--draft" else "target"
        raise CLIError(f"{option} {path}: a demo training run's output, not a checkpoint: pass {Path(path) / member}, "
                       f"or set SSM_SPEC_DEMO_DIR={path} and pass {option} demo")
    if not (p / "config.json").is_file():
        raise CLIError(f"{option} {path}: no config.json: not a transformers checkpoint directory")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise CLIError(f"{option} {path}: no weights (*.safetensors or *.bin): not a saved model")
    return p
