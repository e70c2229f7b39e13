"""``ssm-spec generate``'s checks that need torch or transformers, and the loading.

The device (:func:`check_device`), the configs of ``--model`` and ``--draft``
(:func:`check_model_dir`, :func:`check_draft`), the process set-up (:func:`setup`), and the
tokenizer, target and draft (:func:`load_tokenizer`, :func:`load_model`, :func:`load_draft`):
the tiny random model, the packaged demo pair (resolved to its directories by
:func:`~ssm_spec.hf.cli_args.resolve_names`) or local checkpoints, never a download.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import torch

from .cli_args import DRAFT_KEYWORDS, DTYPE_NAMES, TINY_KIND, CLIError, checkpoint_dir, note

__all__ = ["DTYPES", "TOKENIZER_FILES", "check_device", "check_draft", "check_model_dir", "check_mtp",
           "length_warning", "load_draft", "load_mtp_check", "load_model", "load_tokenizer", "max_positions",
           "release_memory", "setup", "threads_for"]

#: ``--dtype``'s names to torch dtypes.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model")


class _Tokenizer:
    """A transformers tokenizer or a ByteTokenizer behind one ``encode`` / ``decode``."""

    def __init__(self, tok, name: str):
        self.tok = tok
        self.name = name

    def encode(self, text: str, device) -> torch.Tensor:
        """The token ids of ``text`` as a ``[1, L]`` long tensor on ``device``.

        Raises:
            CLIError: ``text`` encodes to no tokens.
        """
        from .tiny import ByteTokenizer

        if isinstance(self.tok, ByteTokenizer):
            ids = self.tok.encode(text)
        else:
            ids = self.tok(text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise CLIError("--prompt: the prompt encodes to no tokens")
        return torch.tensor([ids], dtype=torch.long, device=device)

    def decode(self, ids) -> str:
        """The text of token ids ``ids`` (special tokens skipped)."""
        from .tiny import ByteTokenizer

        if isinstance(self.tok, ByteTokenizer):
            return self.tok.decode(ids)
        return self.tok.decode(ids, skip_special_tokens=True)


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
    """Check ``--draft`` before anything loads: ``prompt-lookup``, ``self``, ``mtp``
    (:func:`check_mtp`), or a local checkpoint directory whose config reads. Returns that config
    (``None`` for the keywords).

    Raises:
        CLIError: anything else (the message names the valid values); ``mtp`` for a model
            without an MTP head.
    """
    if args.draft == "mtp":
        check_mtp(args)
    if args.draft in DRAFT_KEYWORDS:
        return None
    return _load_config(checkpoint_dir(args.draft, "--draft"), "--draft")


def check_mtp(args) -> int:
    """Check, before any weight loads, that ``--model`` has an MTP head for ``--draft mtp``: a
    checkpoint (not the tiny random model) whose config declares its MTP layers
    (``mtp_num_hidden_layers`` / ``num_nextn_predict_layers``) and whose safetensors hold
    ``mtp.*`` tensors (their names are read, not the tensors). Returns the layer count.

    Raises:
        CLIError: the tiny random model; a config without the layer count (or 0); no ``mtp.*``
            tensors, or weights that cannot be read.
    """
    from .mtp import config_layer_count, mtp_tensor_files

    if args.model is None:
        raise CLIError("--draft mtp: the tiny random model has no MTP head (mtp.* weights); pass --model with a "
                       "checkpoint that has one")
    path = checkpoint_dir(args.model, "--model")
    try:
        count = config_layer_count(_load_config(path, "--model"))
        where, files = mtp_tensor_files(path)
    except ValueError as exc:  # no count, no weights, or weights that cannot be read (the message says which)
        raise CLIError(f"--draft mtp: --model {path} cannot draft with an MTP head: "
                       f"{str(exc).removeprefix('MTP head: ')}") from None
    if not files:
        raise CLIError(f"--draft mtp: --model {path} has no MTP head: no mtp.* tensors in {where} (its config "
                       f"declares {count} MTP layer(s))")
    return count


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
    """The causal LM saved at ``path`` in ``dtype`` on ``device``, in eval mode (local files only).

    Raises:
        CLIError: it does not load (an unsupported architecture, missing or broken weights);
            the message names ``option``.
    """
    from transformers import AutoModelForCausalLM

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
    path = checkpoint_dir(args.model, "--model")
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
    path = checkpoint_dir(args.model, "--model")
    desc = f"the demo model, trained on the standard library ({path})" if getattr(args, "demo_model", False) \
        else f"{path} ({config.model_type})"
    return _load_pretrained(path, "--model", dtype, device), desc


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

    path = checkpoint_dir(args.model, "--model")
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
        note(args, f"{path} has no usable tokenizer ({why}); its vocabulary size ({vocab}) is the byte "
                   "tokenizer's: using ssm_spec.hf.ByteTokenizer")
        return _Tokenizer(ByteTokenizer(), "byte")
    raise CLIError(f"--model {path}: no usable tokenizer ({why}), and its vocabulary size ({vocab}) is not the "
                   f"byte tokenizer's ({ByteTokenizer.vocab_size})")


def load_draft(args, target, device, dtype):
    """The assistant model for ``--draft``: ``None`` for prompt lookup and for ``mtp`` (the
    target's own head, :func:`load_mtp_check`), ``target`` for ``self``, else the checkpoint at the path, converted with ``apply_recoverssm`` when it has GDN layers.
    Its generation config is set to draft ``--num-draft-tokens`` tokens per round.

    Returns ``(draft_or_None, description)``.

    Raises:
        CLIError: a missing or unloadable draft checkpoint.
    """
    from .apply import apply_recoverssm

    k = args.num_draft_tokens
    if args.draft == "prompt-lookup":
        return None, f"prompt lookup, {k} tokens"
    if args.draft == "mtp":
        return None, f"the checkpoint's MTP head, {k} tokens"
    check_draft(args)
    if args.draft == "self":
        draft, what = target, "the model itself"
    else:
        path = checkpoint_dir(args.draft, "--draft")
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


def load_mtp_check(model, path) -> int:
    """Read ``model``'s MTP head from its checkpoint once, before any timed run, so that tensors
    that do not fit fail in seconds (``generate(use_mtp=True)`` reads it again on its first call).
    Returns the head's layer count.

    Raises:
        CLIError: as :func:`~ssm_spec.hf.mtp.load_mtp_head` (missing, unexpected or misshapen
            ``mtp.*`` tensors), naming ``--model path``.
    """
    from .mtp import load_mtp_head

    try:
        return load_mtp_head(model).num_layers
    except ValueError as exc:
        raise CLIError(f"--draft mtp: --model {path}: {str(exc).removeprefix('MTP head: ')}") from None


def threads_for(args, device) -> int | None:
    """torch's intra-op thread count for ``args`` on ``device``: ``--threads``, else 1 on a CPU
    device unless ``$OMP_NUM_THREADS`` chose one, else None (torch's own)."""
    if getattr(args, "threads", None) is not None:
        return args.threads
    if torch.device(device).type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        return 1
    return None


def setup(args, device=None) -> torch.dtype:
    """Quiet transformers (its progress bars too with ``--quiet`` or where stderr is not a
    terminal), set torch's threads (:func:`threads_for`, given ``device``), pick the dtype, and
    make fp32 matmuls IEEE (no TF32).

    Returns the torch dtype of ``args.dtype``.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    if args.quiet or not sys.stderr.isatty():  # bars redrawn with carriage returns only fill a log
        transformers.utils.logging.disable_progress_bar()
    threads = None if device is None else threads_for(args, device)
    if threads is not None:
        torch.set_num_threads(threads)
    dtype = DTYPES[args.dtype]
    if dtype == torch.float32:  # fp32 runs are exact: keep TF32 out of matmuls, convs and Triton dots
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dtype


def release_memory() -> None:
    """Collect garbage and return cached CUDA memory (after the models are dropped)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
