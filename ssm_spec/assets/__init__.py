"""Checkpoints that ship inside the package: the demo pair.

``demo/target`` and ``demo/draft`` are a byte-level Qwen3.5-shaped model and its draft trained by
``scripts/train_demo_model.py`` on the Python standard library's source (``demo/demo.json`` holds
the command, the data split, the held-out bits per byte and the corpus licence). A build without
them (before the training run landed) answers :func:`demo_checkpoint` with a clear error.
``SSM_SPEC_DEMO_DIR`` points the lookup at another directory of the same layout (a training
run's ``--out``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEMO_NAMES", "demo_dir", "demo_available", "demo_checkpoint"]

#: The members of the demo pair.
DEMO_NAMES = ("target", "draft")


def demo_dir() -> Path:
    """Where the demo pair is looked up: ``$SSM_SPEC_DEMO_DIR`` if set, else the package's
    ``assets/demo``."""
    env = os.environ.get("SSM_SPEC_DEMO_DIR")
    return Path(env).expanduser() if env else Path(__file__).resolve().parent / "demo"


def demo_available(name: str = "target") -> bool:
    """Whether ``name`` (``"target"`` or ``"draft"``) is there: a ``config.json`` and safetensors weights."""
    path = demo_dir() / name
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def demo_checkpoint(name: str = "target") -> Path:
    """The directory of the demo ``name`` (``"target"`` or ``"draft"``), for ``from_pretrained``.

    Raises:
        ValueError: ``name`` is not one of :data:`DEMO_NAMES`.
        FileNotFoundError: the checkpoint is not in this build, or not in ``$SSM_SPEC_DEMO_DIR`` when
            that is set (the message says which, and how to make one).
    """
    if name not in DEMO_NAMES:
        raise ValueError(f"name: expected one of {DEMO_NAMES}, got {name!r}")
    if not demo_available(name):
        where = (f"not in SSM_SPEC_DEMO_DIR={os.environ['SSM_SPEC_DEMO_DIR']}" if os.environ.get("SSM_SPEC_DEMO_DIR")
                 else "not in this build")
        raise FileNotFoundError(
            f"the demo {name} is {where} ({demo_dir() / name} has no config.json and safetensors weights): train "
            "the pair with 'python scripts/train_demo_model.py --out DIR' and set SSM_SPEC_DEMO_DIR=DIR (or pass "
            f"the path DIR/{name})")
    return demo_dir() / name
