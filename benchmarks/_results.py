"""What the benchmark scripts share for their output: the help formatter, where results go, how the
JSON and the plot are written, and the device's name in file names (the timer is ``timing.py``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import warnings
from pathlib import Path

#: The committed results (GPU runs quoted in the READMEs): written only on request (``--save``
#: or an explicit ``--out-dir``), so a smoke run cannot overwrite them.
RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: Where a run writes when not asked for a place: git-ignored (``/benchmarks/out/`` in .gitignore).
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except device-dependent ones (``None``: described in the help) and those of
    flags (``--no-graphs`` would read "default: True": the flag is off by default)."""

    def _get_help_string(self, action):
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        return action.help if action.default is None or flag else super()._get_help_string(action)


def add_out_args(p: argparse.ArgumentParser) -> None:
    """``--out-dir`` and ``--save``: where the JSON and the plot go."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--out-dir", type=Path, default=None,
                   help=f"where the JSON and the plot go (default {DEFAULT_OUT_DIR.parent.name}/"
                        f"{DEFAULT_OUT_DIR.name}/, git-ignored)")
    g.add_argument("--save", action="store_true",
                   help=f"write into {RESULTS_DIR.parent.name}/{RESULTS_DIR.name}/, the committed "
                        "results (a full GPU run only)")


def resolve_out_dir(p: argparse.ArgumentParser, args: argparse.Namespace, smoke: bool) -> None:
    """Set ``args.out_dir``: ``--out-dir`` as given, ``--save`` the committed results folder,
    else the git-ignored default. A smoke run (``smoke``: a CPU or ``--quick`` run, whose numbers
    mean nothing) may not write into the committed results, by ``--save`` or by an ``--out-dir``
    inside them (usage error, exit status 2)."""
    if args.save:
        if smoke:
            p.error(f"--save writes the committed results in {RESULTS_DIR}; a CPU or --quick "
                    "smoke run must not replace them (use --out-dir to keep its output)")
        args.out_dir = RESULTS_DIR
    elif args.out_dir is None:
        args.out_dir = DEFAULT_OUT_DIR
    elif smoke and Path(args.out_dir).resolve().is_relative_to(RESULTS_DIR):
        p.error(f"--out-dir {args.out_dir} is inside the committed results ({RESULTS_DIR}); a CPU or "
                "--quick smoke run must not write there")


class PartialResults:
    """What a long run has measured so far, kept on disk as it goes: each call merges its keyword
    arguments into ``<out_dir>/<stem>.partial.json`` (``{"partial": true, ...}``, replaced whole
    each time), so a run killed by a time limit leaves its finished rows behind;
    :func:`write_results` removes the file when the whole result is written. A failed write warns
    and the run goes on (the rows are a convenience, the run is the point)."""

    def __init__(self, out_dir: Path, stem: str):
        self.path = Path(out_dir) / f"{stem}.partial.json"
        self.parts: dict = {}

    def __call__(self, **parts) -> None:
        self.parts.update(parts)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"partial": True, **self.parts}, indent=2, default=str) + "\n")
            os.replace(tmp, self.path)
        except (OSError, TypeError, ValueError) as exc:
            warnings.warn(f"could not keep the rows measured so far in {self.path}: {exc}", RuntimeWarning,
                          stacklevel=2)


def write_results(res: dict, out_dir: Path, stem: str, save_plot) -> None:
    """Write ``res`` as ``<out_dir>/<stem>.json`` and, where ``save_plot(res, path)`` can
    (matplotlib installed), ``<stem>.png``; print each path written. A run's
    ``<stem>.partial.json`` (:class:`PartialResults`) is removed."""
    out_dir = Path(out_dir)
    note = ("the committed results" if out_dir.resolve() == RESULTS_DIR
            else "git-ignored; --save writes the committed results" if out_dir.resolve() == DEFAULT_OUT_DIR
            else "--out-dir")
    print(f"results go to {out_dir} ({note})")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {json_path}")
    (out_dir / f"{stem}.partial.json").unlink(missing_ok=True)
    png_path = out_dir / f"{stem}.png"
    if save_plot(res, png_path):
        print(f"wrote {png_path}")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (saying so) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    return plt


def device_name(device) -> str:
    """The GPU's name, or ``cpu-<machine>``."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine() or 'unknown'}"


def slug(text: str) -> str:
    """``text`` as a file-name part: lower case, runs of other characters as ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
