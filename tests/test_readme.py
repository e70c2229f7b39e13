"""The code of README.md and of the pages under docs/ runs as written, and the README's test
command is what CI runs.

Every ```python block of README.md and docs/*.md is run on its own, in a fresh interpreter
started outside the repository (the installed package, not the source tree on the path), on
the CPU (CUDA hidden), with the tiny sizes the blocks choose themselves. A block that raises,
or that needs a name an earlier block defined, fails its test. There is no skip marker: every
block must run. Each user path keeps its runnable blocks (``EXPECTED_PYTHON_BLOCKS``): a block
that moves between pages moves in that table too.

The shell commands are not run (they build a virtual environment), but the README's test
command must be exactly what ``.ci/run`` runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def code_blocks(text: str, name: str = "README.md") -> list[tuple[str, int, str]]:
    """``(language, first line number, code)`` of every fenced block of the file ``name``,
    dedented (blocks inside a list item are indented)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i + 1
        i += 1
        while i < len(lines) and not (FENCE.match(lines[i]) and lines[i].strip() == "```"):
            i += 1
        if i == len(lines):
            raise ValueError(f"{name}:{start}: unclosed code block")
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[start:i])
        blocks.append((lang, start + 1, textwrap.dedent(body) + "\n"))
        i += 1
    return blocks


README_BLOCKS = code_blocks((ROOT / "README.md").read_text())
DOC_FILES = ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")))]
#: ``(file:line, code)`` of every Python block of README.md and docs/*.md
PYTHON_BLOCKS = [(f"{name}:{line}", code) for name in DOC_FILES
                 for lang, line, code in code_blocks((ROOT / name).read_text(), name) if lang == "python"]
#: the fewest Python blocks each page must hold: the README's Hugging Face, ops and capture blocks;
#: docs/: the decode loop, the short conv and the modules, fast mode, a device map
EXPECTED_PYTHON_BLOCKS = {"README.md": 3, "docs/huggingface.md": 1, "docs/ops-and-modules.md": 2,
                          "docs/fast-mode.md": 1, "docs/multi-gpu.md": 1}


def test_the_extraction_finds_the_blocks():
    blocks = code_blocks("text\n```python\nx = 1\n```\n\n1. item\n\n   ```bash\n   echo hi\n   ```\n")
    assert blocks == [("python", 3, "x = 1\n"), ("bash", 9, "echo hi\n")]
    counts = {name: sum(where.startswith(name + ":") for where, _ in PYTHON_BLOCKS) for name in DOC_FILES}
    assert all(counts.get(name, 0) >= n for name, n in EXPECTED_PYTHON_BLOCKS.items()), counts


@pytest.mark.parametrize("where,code", PYTHON_BLOCKS, ids=[where for where, _ in PYTHON_BLOCKS])
def test_readme_python_block_runs(where, code, tmp_path):
    # OMP_NUM_THREADS: conftest's (1 unless the caller chose). The README's Hugging Face block took
    # 20 s with one thread, 17 s with two on idle cores, 47 s with two beside the other xdist worker.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TMPDIR": str(tmp_path)}  # what a block leaves in a temporary directory goes with tmp_path
    env.pop("PYTHONPATH", None)  # the installed package, as a reader has it
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{where}: the block fails:\n{proc.stderr[-4000:]}"


def _ci_commands() -> list[str]:
    """``.ci/run``'s command lines (no comments, shell options or ``cd``)."""
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(("#", "set ", "cd "))]


def test_readme_test_command_is_what_ci_runs():
    commands = _ci_commands()
    ci = "\n".join(commands)
    bash = [code.strip() for lang, _, code in README_BLOCKS if lang == "bash"]
    assert ci in bash, f".ci/run runs {ci!r}; the README's shell blocks are {bash}"
    assert commands[0].endswith("&& .venv/bin/python -m pytest -q -n 2 --dist worksteal")
    ci = commands[0]
    # the main job's command sets up the same way (same venv, same torch pin), extras aside
    setup = ci.split(" -e ")[0]
    fresh = [cmd for cmd in bash if cmd.startswith("python3 -m venv")]  # the two setup commands
    assert len(fresh) >= 2 and all(cmd.startswith(setup + " -e ") for cmd in fresh), (setup, fresh)
