"""Lazy package attributes for the ``ssm-spec`` command (standard library only).

``import ssm_spec`` imports torch and registers the ops (``torch.ops.ssm_spec.*``), and
``import ssm_spec.hf`` imports transformers: 2-4 s on a CPU machine, more when it is busy.
The command needs neither to print ``--help`` or refuse an argument, so when this process
is the command (:func:`command_line`) the two packages import nothing at first and load each
public name on first use (:func:`lazy_attributes`); the command imports what its subcommand
runs after parsing. Any other process imports them as before.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable

__all__ = ["command_line", "lazy_attributes"]

COMMAND = "ssm-spec"


@functools.cache
def command_line() -> bool:
    """Whether this process is the ``ssm-spec`` command: its console script (``sys.argv[0]``
    is the script, while it imports the package), or ``python -m ssm_spec`` (``sys.argv[0]``
    is ``-m`` while Python locates the module, and the original command line names it).
    Decided once, when ``ssm_spec`` is imported (``-m`` leaves ``sys.argv[0]`` after that)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 == "-m":
        orig = list(getattr(sys, "orig_argv", ()))
        return "-m" in orig and orig.index("-m") + 1 < len(orig) and orig[orig.index("-m") + 1] == "ssm_spec"
    name = os.path.basename(argv0)
    return name in (COMMAND, f"{COMMAND}.exe", f"{COMMAND}-script.py")


def lazy_attributes(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``where[name]`` is the submodule that defines
    ``name`` (``name`` itself for a submodule), imported on first use."""

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(f"{package}.{module}")
        return loaded if module == name else getattr(loaded, name)

    return __getattr__
