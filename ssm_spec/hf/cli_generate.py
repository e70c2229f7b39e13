"""``ssm-spec generate``: speculative decoding on a Qwen3-Next / Qwen3.5 model from the shell.

Loads the packaged demo model (the default), a local checkpoint or the embedded tiny random
model, and times three ``generate`` runs
of it, each the median of ``--repeats`` calls: plain transformers (the model as loaded), the
model converted by :func:`~ssm_spec.hf.apply_recoverssm` without drafts, and the converted
model with prompt lookup, a draft model or the checkpoint's own MTP head (``--draft mtp``:
``generate(use_mtp=True, num_assistant_tokens=K)``). It prints the text and a table: the three tokens/s,
the speed-ups (each line naming the two runs it divides), the torch thread count, a note when
the machine looked busy, and the acceptance statistics of the
:class:`~ssm_spec.hf.RecoverSSMCache`. With ``--check`` it reports whether the drafted run's
tokens equal plain transformers' greedy tokens.

Every argument is checked before any model loads (the device, ``--draft``, ``--model``, the
option values); a bad one gives a one-line ``ssm-spec generate: error: ...``.

Exit status: 0 on success; 1 when ``--check`` finds tokens that differ from plain greedy; 2 on
a usage error, a missing checkpoint, or a model that is not Qwen3-Next / Qwen3.5.

This module holds the command's sequence (:func:`run`) and its entry (:func:`main`); the parts
are in :mod:`~ssm_spec.hf.cli_args` (the options and the checks that need no model, importing
neither torch nor transformers), :mod:`~ssm_spec.hf.cli_loading` (the device and config checks,
the model, tokenizer and draft), :mod:`~ssm_spec.hf.cli_timing` (the timed ``generate`` runs)
and :mod:`~ssm_spec.hf.cli_report` (the text and the table).
"""

from __future__ import annotations

import sys

# besides run and main, the names this module held before its parts moved out: the console
# script, the tests and benchmarks/hf_demo.py import them from here

from .cli_args import (DEFAULT_PROMPT, DRAFT_KEYWORDS, TINY_KIND, CLIError, add_arguments, check_values,
                       error_line, resolve_names)
from .cli_loading import (DTYPES, TOKENIZER_FILES, _load_pretrained, check_device, check_draft, check_model_dir,
                          length_warning, load_draft, load_model, load_mtp_check, load_tokenizer, max_positions,
                          release_memory, setup)
from .cli_report import (BUSY_CPU_FRACTION, BUSY_SPREAD, POSITIONS_SHOWN, RANDOM_WEIGHTS_NOTE, busy_note,
                         format_table, print_report, printable, usable_cpus)
from .cli_timing import ProgressStreamer, RunResult, timed_generate

__all__ = ["DEFAULT_PROMPT", "CLIError", "ProgressStreamer", "RunResult", "add_arguments", "busy_note", "main"]


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
    check_values(args)
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
    dtype = setup(args, device)
    tokenizer = load_tokenizer(args)
    input_ids = tokenizer.encode(args.prompt, device)
    warning = length_warning(input_ids.shape[1], args.max_new_tokens,
                             max_positions(config if config is not None else tiny_config(TINY_KIND)))
    if warning:
        print(warning, file=sys.stderr)

    model, model_desc = load_model(args, device, dtype)
    if args.draft == "mtp":  # the head's tensors are read once here: a misshapen one fails before any timing
        load_mtp_check(model, args.model)
    early = args.draft not in ("prompt-lookup", "self", "mtp")  # a checkpoint: an unloadable one fails before timing
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
    if args.draft == "mtp":  # the checkpoint's own head, inside ssm-spec's decode loop
        speculative = {"use_mtp": True, "num_assistant_tokens": args.num_draft_tokens}
    elif draft is None:
        speculative = {"prompt_lookup_num_tokens": args.num_draft_tokens}
    else:
        speculative = {"assistant_model": draft}
    spec = timed_generate(model, input_ids, args, desc="converted, with drafts", speculative=speculative)
    del model, draft, speculative
    release_memory()
    return print_report(args, tokenizer, device, dtype, graphs, model_desc, draft_desc, plain, converted, spec)


def main(args) -> int:
    """Entry point for parsed ``args``: :func:`run`, with a :class:`CLIError` printed to stderr
    as ``ssm-spec generate: error: ...`` and turned into exit status 2. torch's thread count
    (``--threads``) is restored on return (the command may run inside another program)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return run(args)
    except CLIError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
