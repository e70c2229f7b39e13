"""``ssm-spec generate``: speculative decoding on a Qwen3-Next / Qwen3.5 model from the shell.

Loads the packaged demo model (the default), a local checkpoint or the embedded tiny random
model, and times three ``generate`` runs
of it, each the median of ``--repeats`` calls: plain transformers (the model as loaded), the
model converted by :func:`~ssm_spec.hf.apply_recoverssm` without drafts, and the converted
model with prompt lookup or a draft model. It prints the text and a table: the three tokens/s,
the speed-ups (each line naming the two runs it divides), the torch thread count, a note when
the machine looked busy, and the acceptance statistics of the
:class:`~ssm_spec.hf.RecoverSSMCache`. With ``--check`` it reports whether the drafted run's
tokens equal plain transformers' greedy tokens.

Every argument is checked before any model loads (the device, ``--draft``, ``--model``, the
option values); a bad one gives a one-line ``ssm-spec generate: error: ...``.

Exit status: 0 on success; 1 when ``--check`` finds tokens that differ from plain greedy; 2 on
a usage error, a missing checkpoint, or a model that is not Qwen3-Next / Qwen3.5.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

__all__ = ["DEFAULT_PROMPT", "CLIError", "ProgressStreamer", "RunResult", "add_arguments", "busy_note", "main"]

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
POSITIONS_SHOWN = 8  # per-position acceptance rates printed
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DRAFT_KEYWORDS = ("prompt-lookup", "self")
#: The line printed before the default model's text.
RANDOM_WEIGHTS_NOTE = ("note: --model tiny-random has random weights, so its text is random bytes (not language); "
                       "the default, --model demo, is a trained model, and --model PATH runs a checkpoint")
#: ``busy_note``'s thresholds: process CPU time over wall time of the timed calls below this, and
#: the slowest over the fastest of one configuration's repeats above ``BUSY_SPREAD``.
BUSY_SPREAD = 1.5
BUSY_CPU_FRACTION = 0.5


class CLIError(Exception):
    """A user-facing error: its message goes to stderr and the command exits with status 2."""


# ---------------------------------------------------------------------------------- arguments
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
    parser.add_argument("--draft", default="prompt-lookup", metavar="prompt-lookup|self|demo|PATH",
                        help="where drafts come from: prompt lookup (default), 'self' (the model drafts for "
                             "itself: every draft is accepted), 'demo' (the packaged demo draft), or a local "
                             "causal LM checkpoint used as the assistant model (converted with apply_recoverssm "
                             "when it has GDN layers)")
    parser.add_argument("--num-draft-tokens", type=int, default=5, metavar="K",
                        help="drafts per round: prompt_lookup_num_tokens, or the assistant's "
                             "num_assistant_tokens (5)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0, metavar="P",
                        help="the assistant's assistant_confidence_threshold: it stops drafting early when its "
                             "top probability drops below P (default 0: always draft K tokens; transformers' "
                             "own default is 0.4)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                        help="replay the model's forwards after the prompt as CUDA graphs "
                             "(apply_recoverssm(cuda_graphs=True)); auto: on a CUDA device (default)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
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
                        help="no progress bars or notes on stderr (the text and the table still print)")


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
            _note(args, f"this build has no demo model ({demo_dir()}): running the tiny random model "
                        "(--model tiny-random)")
    elif args.model == "tiny-random":
        args.model = None
    elif args.model == "demo":
        args.model = demo("target", "--model")


def _validate(args) -> None:
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.num_draft_tokens < 1:
        raise CLIError(f"--num-draft-tokens: expected >= 1, got {args.num_draft_tokens}")
    if args.repeats < 1:
        raise CLIError(f"--repeats: expected >= 1, got {args.repeats}")
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


# ---------------------------------------------------------------------------------- progress
class ProgressStreamer(BaseStreamer):
    """A ``generate`` streamer that advances a tqdm bar by the tokens each ``put`` brings.

    ``generate`` calls ``put`` first with the prompt (skipped), then with each step's new tokens
    (assisted generation and prompt lookup put several at once), and ``end`` when done.

    Args:
        total: the bar's length (``max_new_tokens``).
        desc: the bar's label.
        disable: no bar at all (``--quiet``).

    Attributes:
        tokens: new tokens seen so far.
    """

    def __init__(self, total: int, desc: str = "generating", disable: bool = False):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="tok", disable=disable, leave=False, file=sys.stderr)
        self.tokens = 0
        self._prompt_seen = False

    def put(self, value) -> None:
        """Count ``value`` (token ids of batch 1); the first call (the prompt) is skipped."""
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        n = int(value.numel()) if isinstance(value, torch.Tensor) else len(value)
        self.tokens += n
        self.bar.update(n)

    def end(self) -> None:
        """Close the bar."""
        self.bar.close()


# ---------------------------------------------------------------------------------- loading
class _Tokenizer:
    """A transformers tokenizer or a ByteTokenizer behind one ``encode`` / ``decode``."""

    def __init__(self, tok, name: str):
        self.tok = tok
        self.name = name

    def encode(self, text: str, device) -> torch.Tensor:
        from .tiny import ByteTokenizer

        if isinstance(self.tok, ByteTokenizer):
            ids = self.tok.encode(text)
        else:
            ids = self.tok(text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise CLIError("--prompt: the prompt encodes to no tokens")
        return torch.tensor([ids], dtype=torch.long, device=device)

    def decode(self, ids) -> str:
        from .tiny import ByteTokenizer

        if isinstance(self.tok, ByteTokenizer):
            return self.tok.decode(ids)
        return self.tok.decode(ids, skip_special_tokens=True)


def _note(args, message: str) -> None:
    if not args.quiet:
        print(f"note: {message}", file=sys.stderr)


def _checkpoint_dir(path: str, option: str) -> Path:
    if not str(path).strip():
        expected = ("prompt-lookup, self, demo, or a local checkpoint directory" if option == "--draft"
                    else "tiny-random, demo, or a local checkpoint directory")
        raise CLIError(f"{option}: empty (expected {expected})")
    p = Path(path).expanduser()
    if not p.exists():
        expected = ("prompt-lookup, self, demo, or a local checkpoint directory" if option == "--draft"
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


def _load_config(path: Path, option: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # an unknown model type, a broken config.json: all user-facing
        raise CLIError(f"{option} {path}: cannot read its config: {exc}") from exc


def check_device(spec: str | None) -> torch.device:
    """The torch device for ``--device`` (default: cuda if available, else cpu), checked by
    allocating an empty tensor on it.

    Raises:
        CLIError: not a device name torch knows, or a device this machine does not have.
    """
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        raise CLIError(f"--device {spec}: not a torch device (expected cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise CLIError(f"--device {spec}: not supported (expected cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {spec}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CLIError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # a backend torch knows but this build or machine lacks (mps, xpu, ...)
        raise CLIError(f"--device {spec}: not usable here ({type(exc).__name__}: {str(exc)[:200]})") from None
    return device


def check_draft(args):
    """Check ``--draft`` before anything loads: ``prompt-lookup``, ``self``, or a local
    checkpoint directory whose config reads. Returns that config (``None`` for the keywords).

    Raises:
        CLIError: anything else (the message names the valid values).
    """
    if args.draft in DRAFT_KEYWORDS:
        return None
    return _load_config(_checkpoint_dir(args.draft, "--draft"), "--draft")


def max_positions(config) -> int | None:
    """The text config's ``max_position_embeddings`` (None when it has none)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def length_warning(prompt_tokens: int, max_new_tokens: int, limit: int | None) -> str | None:
    """The warning for a prompt plus ``--max-new-tokens`` longer than ``limit`` (the model's
    ``max_position_embeddings``), or None."""
    if limit is None or prompt_tokens + max_new_tokens <= limit:
        return None
    return (f"warning: the prompt ({prompt_tokens} tokens) plus --max-new-tokens ({max_new_tokens}) is "
            f"{prompt_tokens + max_new_tokens} tokens, more than the model's max_position_embeddings ({limit}): "
            "positions past it were not trained and the text may degrade")


def _has_gdn(model) -> bool:
    return any(isinstance(getattr(m, "linear_attn", None), torch.nn.Module) for m in model.modules())


def _load_pretrained(path: Path, option: str, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM

    import importlib.util

    # transformers 5.25 kernelizes every loaded model through the `kernels` package, a dependency
    # it requires; where it was installed without it (--no-deps), load without kernelizing
    extra = {} if importlib.util.find_spec("kernels") is not None else {"use_kernels": False}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **extra)
    except Exception as exc:  # unsupported architecture, missing weights: all user-facing
        raise CLIError(f"{option} {path}: cannot load it as a causal LM: {exc}") from exc
    return model.to(device).eval()


def check_model_dir(args):
    """Check ``--model`` before anything loads: a local directory with a config of a model that
    has linear-attention (GatedDeltaNet) layers. Returns its config (``None`` for the tiny model).

    Raises:
        CLIError: a missing directory, no or an unreadable ``config.json``, or a config with no
            ``linear_attention`` layer (not Qwen3-Next / Qwen3.5).
    """
    if args.model is None:
        return None
    path = _checkpoint_dir(args.model, "--model")
    config = _load_config(path, "--model")
    text = config.get_text_config(decoder=True)
    if "linear_attention" not in (getattr(text, "layer_types", None) or ()):
        raise CLIError(f"--model {path}: not a Qwen3-Next / Qwen3.5 model: its {config.model_type} config has no "
                       "linear_attention (GatedDeltaNet) layer")
    return config


def load_model(args, device, dtype):
    """The target model (not yet converted) for ``args``: ``--model PATH`` (through
    ``AutoModelForCausalLM``, local files only) or the tiny model.

    Returns ``(model, description)``.

    Raises:
        CLIError: as :func:`check_model_dir`, or weights that do not load.
    """
    if args.model is None:
        from .tiny import tiny_model

        model = tiny_model(TINY_KIND, seed=args.seed, dtype=dtype).to(device)
        return model, f"tiny {TINY_KIND} (random weights, seed {args.seed})"
    config = check_model_dir(args)
    path = _checkpoint_dir(args.model, "--model")
    desc = f"the demo model, trained on the standard library ({path})" if getattr(args, "demo_model", False) \
        else f"{path} ({config.model_type})"
    return _load_pretrained(path, "--model", dtype, device), desc


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(args) -> _Tokenizer:
    """The tokenizer for ``args``: ByteTokenizer for the tiny model, else ``AutoTokenizer`` from
    the ``--model`` directory. A directory without a usable tokenizer (no tokenizer files, a
    load that fails, or an empty vocabulary) falls back to ByteTokenizer when the config's
    vocabulary is the byte tokenizer's (a saved tiny model), with a note.

    Raises:
        CLIError: no usable tokenizer and the vocabulary is not the byte tokenizer's.
    """
    from .tiny import ByteTokenizer

    if args.model is None:
        return _Tokenizer(ByteTokenizer(), "byte")
    from transformers import AutoTokenizer

    path = _checkpoint_dir(args.model, "--model")
    why = "no tokenizer files"
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        else:
            if len(tok) > 1:  # transformers can build an empty tokenizer from a bare config
                return _Tokenizer(tok, "auto")
            why = "an empty vocabulary"
    vocab = getattr(_load_config(path, "--model").get_text_config(decoder=True), "vocab_size", None)
    if vocab == ByteTokenizer.vocab_size:
        if getattr(args, "demo_model", False):  # the demo pair is byte-level by construction
            return _Tokenizer(ByteTokenizer(), "byte")
        _note(args, f"{path} has no usable tokenizer ({why}); its vocabulary size ({vocab}) is the byte "
                    "tokenizer's: using ssm_spec.hf.ByteTokenizer")
        return _Tokenizer(ByteTokenizer(), "byte")
    raise CLIError(f"--model {path}: no usable tokenizer ({why}), and its vocabulary size ({vocab}) is not the "
                   f"byte tokenizer's ({ByteTokenizer.vocab_size})")


def load_draft(args, target, device, dtype):
    """The assistant model for ``--draft``: ``None`` for prompt lookup, ``target`` for ``self``,
    else the checkpoint at the path, converted with ``apply_recoverssm`` when it has GDN layers.
    Its generation config is set to draft ``--num-draft-tokens`` tokens per round.

    Returns ``(draft_or_None, description)``.

    Raises:
        CLIError: a missing or unloadable draft checkpoint.
    """
    from .apply import apply_recoverssm

    k = args.num_draft_tokens
    if args.draft == "prompt-lookup":
        return None, f"prompt lookup, {k} tokens"
    check_draft(args)
    if args.draft == "self":
        draft, what = target, "the model itself"
    else:
        path = _checkpoint_dir(args.draft, "--draft")
        draft = _load_pretrained(path, "--draft", dtype, device)
        what = str(path)
        if _has_gdn(draft):
            try:
                apply_recoverssm(draft)
            except ValueError as exc:
                raise CLIError(f"--draft {path}: {exc}") from exc
            what += " (converted)"
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.assistant_confidence_threshold = args.confidence_threshold
    return draft, f"assistant {what}, {k} tokens"


# ---------------------------------------------------------------------------------- running
@dataclass
class RunResult:
    """The timed ``generate`` calls of one run: the last call's new token ids, the median
    seconds, the (speculative) stats of the last call, and every call's seconds, with the
    process CPU time and wall time over all of them (for :func:`busy_note`)."""

    new_tokens: torch.Tensor
    seconds: float
    stats: object | None = None
    times: tuple[float, ...] = ()
    cpu_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens.numel() / self.seconds if self.seconds > 0 else float("inf")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _gen_kwargs(args, model) -> dict:
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    if args.do_sample and args.temperature is not None:
        kw["temperature"] = args.temperature
    if model.generation_config.pad_token_id is None and model.generation_config.eos_token_id is not None:
        eos = model.generation_config.eos_token_id
        kw["pad_token_id"] = eos[0] if isinstance(eos, (list, tuple)) else eos
    return kw


class _StopAt:
    """A ``generate`` stopping criterion: stop once the sequences hold ``length`` tokens (a
    class of our own: transformers refuses a second ``MaxLengthCriteria``)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


def timed_generate(model, input_ids, args, *, desc: str, speculative: dict | None = None) -> RunResult:
    """Run ``model.generate`` on ``input_ids [1, L]`` once untimed (``--warmup`` tokens), then
    ``--repeats`` times timed, each with a progress bar; the result holds the median time.

    ``speculative`` holds the draft arguments (``prompt_lookup_num_tokens`` or
    ``assistant_model``); when given, ``model`` must be converted, and a fresh
    :class:`~ssm_spec.hf.RecoverSSMCache` is passed so its ``stats`` come back in the result
    (with ``cuda_graphs``, the model's kept graphed cache serves the call and gives them).
    """
    from transformers import StoppingCriteriaList

    from .apply import cache_kwarg, is_converted
    from .cache import RecoverSSMCache
    from .config import kept_cache, recoverssm_config

    kw = _gen_kwargs(args, model)
    kw.update(speculative or {})
    mask = torch.ones_like(input_ids)
    graphed = is_converted(model) and recoverssm_config(model).cuda_graphs
    with torch.inference_mode():
        if args.warmup:
            if args.do_sample:
                torch.manual_seed(args.seed)
            warm = {**kw, "max_new_tokens": args.warmup}
            if graphed:
                # stops after --warmup tokens, but makes the kept cache (and its graphs) the timed call reuses
                warm["stopping_criteria"] = StoppingCriteriaList([_StopAt(input_ids.shape[1] + args.warmup)])
                warm["max_new_tokens"] = args.max_new_tokens
            model.generate(input_ids, attention_mask=mask, **warm)
        times, cpu_s = [], 0.0
        for i in range(args.repeats):
            extra = {}
            if speculative is not None and not graphed:
                cache = RecoverSSMCache(model)  # passed in to read its acceptance stats afterwards
                extra[cache_kwarg(model)] = cache
            label = desc if args.repeats == 1 else f"{desc} {i + 1}/{args.repeats}"
            streamer = ProgressStreamer(args.max_new_tokens, desc=label, disable=args.quiet)
            if args.do_sample:
                torch.manual_seed(args.seed)
            _sync(input_ids.device)
            cpu0, start = time.process_time(), time.perf_counter()
            try:
                out = model.generate(input_ids, attention_mask=mask, streamer=streamer, **kw, **extra)
                _sync(input_ids.device)
            finally:
                streamer.bar.close()
            times.append(time.perf_counter() - start)
            cpu_s += time.process_time() - cpu0
    stats = None
    if speculative is not None:
        stats = kept_cache(model).stats if graphed else extra[cache_kwarg(model)].stats
    return RunResult(out[0, input_ids.shape[1]:].cpu(), statistics.median(times), stats, tuple(times), cpu_s,
                     sum(times))


# ---------------------------------------------------------------------------------- output
def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_note(cpu_s: float, wall_s: float, device_type: str, load_1min: float | None, cpus: int,
              spread: float | None = None) -> str | None:
    """A note when the machine looked busy during the timed calls, or None.

    Two signs, each sound on its own:

    * on a CPU device (``device_type == "cpu"``), process CPU time (all threads) below
      ``BUSY_CPU_FRACTION`` (half) of the wall time. A ``generate`` call there is computation
      in this process, with no device or disk to wait for: on a free machine at least one of
      its threads is running at every moment, so CPU time is at least about the wall time (more
      with torch's intra-op threads). Less than half means the process was runnable but not
      running for over half the time: other processes had the cores. On CUDA the host sleeps in
      synchronisations while the GPU works, so the ratio says nothing there and is not used;
    * on any device, a 1-minute load average (runnable processes, this one included) above the
      number of CPUs this process may use: more work than cores;
    * ``spread``: the largest ratio of the slowest to the fastest of one configuration's timed
      repeats, above ``BUSY_SPREAD``: identical calls whose times differ that much were
      disturbed (intra-op threads spin while they wait, so CPU time alone can miss contention).

    The timings are then inflated by the wait and say little about the code.
    """
    why = []
    if device_type == "cpu" and wall_s > 0 and cpu_s < BUSY_CPU_FRACTION * wall_s:
        why.append(f"this process ran on a CPU for only {cpu_s / wall_s:.0%} of the timed wall time "
                   f"({cpu_s:.2f} s of {wall_s:.2f} s)")
    if load_1min is not None and load_1min > cpus:
        why.append(f"the 1-minute load average ({load_1min:.1f}) exceeds the {cpus} usable CPUs")
    if spread is not None and spread > BUSY_SPREAD:
        why.append(f"repeats of one configuration differ up to {spread:.1f}x")
    if not why:
        return None
    return ("note: the machine looks busy (" + "; ".join(why) + "): other processes competed for the CPUs, "
            "so the times above are inflated and their ratios uncertain")


def _load_1min() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _timing_row(name: str, r: RunResult) -> tuple[str, str]:
    calls = "1 call" if len(r.times) == 1 else f"median of {len(r.times)} calls"
    return (f"tokens/s, {name}", f"{r.tokens_per_s:.1f} ({r.new_tokens.numel()} tokens in {r.seconds:.3f} s, "
                                  f"{calls})")



def printable(text: str) -> str:
    """``text`` with control characters (other than newline and tab) escaped, for a terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def format_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns: ``name  value`` per row."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _stats_rows(stats) -> list[tuple[str, str]]:
    if stats is None or not stats.rounds:
        return [("rounds", "0 (no speculative round ran)")]
    empty = getattr(stats, "empty_rounds", None)  # rounds in which prompt lookup found no draft
    rows = [("rounds", f"{stats.rounds}" + (f" ({empty} in which the draft source proposed nothing)" if empty else "")),
            ("mean accepted length", f"{stats.mean_accepted_length:.2f} tokens per round")]
    if not stats.drafted:
        return rows + [("acceptance rate", "- (no drafts)")]
    rates = stats.position_rates[:POSITIONS_SHOWN]
    more = " ..." if len(stats.position_rates) > POSITIONS_SHOWN else ""
    return rows + [
        ("acceptance rate", f"{stats.acceptance_rate:.1%} ({stats.accepted} of {stats.drafted} drafts)"),
        ("acceptance by position", " ".join(f"{r:.2f}" for r in rates) + more),
    ]


# ---------------------------------------------------------------------------------- main
def _setup(args):
    """Quiet transformers, pick the dtype, and make fp32 matmuls IEEE (no TF32)."""
    import transformers

    transformers.logging.set_verbosity_error()
    if args.quiet:
        transformers.utils.logging.disable_progress_bar()
    dtype = DTYPES[args.dtype]
    if dtype == torch.float32:  # fp32 runs are exact: keep TF32 out of matmuls, convs and Triton dots
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dtype


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args) -> int:
    """Run ``ssm-spec generate`` for parsed ``args``; print the text and the table.

    Every argument is checked first (nothing loads for a bad one); then the model loads once,
    and a draft checkpoint with it (one that does not load fails before any timing), and three
    runs are timed on it: plain transformers (as loaded), then, after
    ``apply_recoverssm`` converts it in place, without drafts and with drafts.

    Returns the exit status: 0, or 1 when ``--check`` finds tokens that differ from plain greedy.

    Raises:
        CLIError: a usage error, a missing checkpoint, a model that is not Qwen3-Next / Qwen3.5.
    """
    from .apply import apply_recoverssm
    from .tiny import tiny_config

    resolve_names(args)
    _validate(args)
    device = check_device(args.device)
    config = check_model_dir(args)  # cheap checks first: nothing loads for a wrong path or model type
    draft_config = check_draft(args)
    target_text = (config if config is not None else tiny_config(TINY_KIND)).get_text_config(decoder=True)
    if draft_config is not None:  # transformers refuses an assistant with another vocabulary, after timing
        want, got = getattr(target_text, "vocab_size", None), getattr(
            draft_config.get_text_config(decoder=True), "vocab_size", None)
        if want != got:
            raise CLIError(f"--draft {args.draft}: its vocabulary has {got} tokens, the model's {want}: an assistant "
                           "must share the model's tokenizer")
    dtype = _setup(args)
    tokenizer = load_tokenizer(args)
    input_ids = tokenizer.encode(args.prompt, device)
    warning = length_warning(input_ids.shape[1], args.max_new_tokens,
                             max_positions(config if config is not None else tiny_config(TINY_KIND)))
    if warning:
        print(warning, file=sys.stderr)

    model, model_desc = load_model(args, device, dtype)
    early = args.draft not in ("prompt-lookup", "self")  # a checkpoint: an unloadable one fails before any timing
    if early:
        draft, draft_desc = load_draft(args, model, device, dtype)
    plain = timed_generate(model, input_ids, args, desc="plain transformers")
    try:
        apply_recoverssm(model)
    except ValueError as exc:
        raise CLIError(f"--model {args.model}: not a Qwen3-Next / Qwen3.5 model: {exc}") from exc
    graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and device.type == "cuda")
    try:
        apply_recoverssm(model, cuda_graphs=graphs)
    except ValueError as exc:
        raise CLIError(f"--cuda-graphs: {exc}") from exc
    converted = timed_generate(model, input_ids, args, desc="converted, no drafts")
    if not early:  # prompt lookup, or the converted model itself
        draft, draft_desc = load_draft(args, model, device, dtype)
    speculative = ({"prompt_lookup_num_tokens": args.num_draft_tokens} if draft is None
                   else {"assistant_model": draft})
    spec = timed_generate(model, input_ids, args, desc="converted, with drafts", speculative=speculative)
    del model, draft, speculative
    _release_memory()

    if args.model is None:
        print(RANDOM_WEIGHTS_NOTE)
    print(printable(tokenizer.decode(spec.new_tokens)))
    print()
    runs = (plain, converted, spec)
    rows = [
        ("model", model_desc),
        ("draft", draft_desc),
        ("device / dtype", f"{device} / {args.dtype}, {'sampling' if args.do_sample else 'greedy'}"
                           + ((", CUDA graphs" if device.type == "cuda" else ", graphed forward run eagerly (no CUDA)")
                              if graphs else "")),
        ("torch threads", f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op "
                          f"({usable_cpus()} usable CPUs)"),
        ("new tokens", str(spec.new_tokens.numel())),
        _timing_row("plain transformers", plain),
        _timing_row("converted, no drafts", converted),
        _timing_row("converted, with drafts", spec),
        ("speed-up over transformers", f"{spec.tokens_per_s / plain.tokens_per_s:.2f}x (tokens/s of converted, "
                                       "with drafts / tokens/s of plain transformers)"),
        ("speed-up from drafts", f"{spec.tokens_per_s / converted.tokens_per_s:.2f}x (tokens/s of converted, with "
                                 "drafts / tokens/s of converted, no drafts)"),
        *_stats_rows(spec.stats),
    ]
    status = 0
    if args.check:
        equal = torch.equal(spec.new_tokens, plain.new_tokens)
        rows.append(("tokens equal plain greedy", "yes" if equal else f"no (first difference at new token "
                                                                      f"{_first_diff(spec.new_tokens, plain.new_tokens)})"))
        if not equal:
            status = 1
    print(format_table(rows))
    spread = max((max(r.times) / min(r.times) for r in runs if len(r.times) > 1 and min(r.times) > 0), default=None)
    busy = busy_note(sum(r.cpu_s for r in runs), sum(r.wall_s for r in runs), device.type, _load_1min(),
                     usable_cpus(), spread)
    if busy:
        print(busy)
    if status and dtype != torch.float32:
        print(f"note: in {args.dtype} the converted layers and transformers' own layers round differently, so "
              "greedy tokens can diverge; the tokens are equal in float32")
    return status


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def main(args) -> int:
    """Entry point for parsed ``args``: :func:`run`, with a :class:`CLIError` printed to stderr
    as ``ssm-spec generate: error: ...`` and turned into exit status 2."""
    try:
        return run(args)
    except CLIError as exc:
        message = re.sub(r"\s*\n\s*", " ", str(exc).strip())  # one line, whatever the cause's text held
        print(f"ssm-spec generate: error: {message}", file=sys.stderr)
        return 2
