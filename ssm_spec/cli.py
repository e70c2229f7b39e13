"""The ssm-spec console script.

ssm-spec selfcheck [--seed N]: run every op against the token-by-token reference on random
data and print a table (exit status 1 if any check fails).

ssm-spec generate [--model tiny-random|demo|PATH] [--draft prompt-lookup|self|demo|PATH]
[--check] ...: speculative decoding with generate on a Qwen3-Next / Qwen3.5 model (default:
``demo``, the packaged demo model trained on the standard library's source; ``tiny-random``: an
embedded tiny model with random weights; no download either way); prints the text, the tokens/s
of plain transformers, of the
converted model without drafts and with drafts (medians of --repeats calls), and acceptance
statistics (exit status 1 if --check finds tokens that differ from plain greedy, 2 on a usage
or model error: checked before any model loads). Needs the hf extra.

``--help`` and the option errors come before torch is imported: run as the command, the
package imports lazily (:mod:`ssm_spec._lazy`), and each subcommand imports what it runs
after parsing.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ssm-spec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("selfcheck", help="run every op against the reference and print a table")
    check.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    gen = sub.add_parser("generate", help="speculative decoding on a Qwen3-Next / Qwen3.5 model with generate",
                         description="Speculative decoding (prompt lookup or a draft model) with transformers' "
                                     "generate on a Qwen3-Next / Qwen3.5 model converted by apply_recoverssm; "
                                     "prints the text, the tokens/s of plain transformers, of the converted model "
                                     "without drafts and with drafts (medians of --repeats calls), and acceptance "
                                     "statistics.")
    if argv[:1] == ["generate"]:  # its options (the standard library alone: no torch before parsing)
        from .hf import cli_args

        cli_args.add_arguments(gen)
    args = parser.parse_args(argv)  # --help and argparse's errors exit here, before torch is imported
    try:
        if args.command == "selfcheck":
            from .selfcheck import main as selfcheck_main

            return selfcheck_main(args.seed)
        if args.command == "generate":
            try:
                cli_args.check_values(args)  # the checks that need no model, still without torch
            except cli_args.CLIError as exc:
                print(cli_args.error_line(exc), file=sys.stderr)
                return 2
            try:
                from .hf import cli_generate
            except ImportError as exc:
                print(f"ssm-spec generate: error: needs transformers (pip install 'ssm-spec[hf]'): {exc}",
                      file=sys.stderr)
                return 2
            return cli_generate.main(args)
    except BrokenPipeError:  # the reader went away (`ssm-spec generate | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
