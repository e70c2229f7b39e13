"""What the benchmark scripts share: their help formatter and how they write results."""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except device-dependent ones (``None``: described in the help)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def write_results(res: dict, out_dir: Path, stem: str, save_plot) -> None:
    """Write ``res`` as ``<out_dir>/<stem>.json`` and, where ``save_plot(res, path)`` can
    (matplotlib installed), ``<stem>.png``; print each path written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {json_path}")
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


class Clock:
    """``time.perf_counter`` with a device synchronisation before each reading (seconds)."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()


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
