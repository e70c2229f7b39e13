"""The ssm-spec console script.

ssm-spec selfcheck [--seed N]: run every op against the token-by-token reference on random
data and print a table (exit status 1 if any check fails).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssm-spec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("selfcheck", help="run every op against the reference and print a table")
    check.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    args = parser.parse_args(argv)
    if args.command == "selfcheck":
        from .selfcheck import main as selfcheck_main

        return selfcheck_main(args.seed)
    return 2


if __name__ == "__main__":
    sys.exit(main())
