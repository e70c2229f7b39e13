"""The ``ssm-spec`` command answers ``--help`` and refuses bad arguments without importing
torch or transformers (2-4 s on a CPU machine): run as the command, ``ssm_spec`` and
``ssm_spec.hf`` load their names on first use (ssm_spec/_lazy.py); any other importer gets
them, and the registered ops, at import as before."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "ssm-spec"  # the console script, where installed


def _command(how, *argv):
    """``ssm-spec ARGV`` with ``-X importtime``: ``python -m ssm_spec`` or the console script."""
    head = [sys.executable, "-X", "importtime"] + (["-m", "ssm_spec"] if how == "module" else [str(SCRIPT)])
    return subprocess.run([*head, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _imported(stderr: str) -> set[str]:
    """The top-level packages ``-X importtime`` lists."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


HOWS = ["module", pytest.param("script", marks=pytest.mark.skipif(not SCRIPT.exists(), reason="no console script"))]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("argv, status, words", [
    (["--help"], 0, "selfcheck,generate"),
    (["generate", "--help"], 0, "--threads N"),
    (["selfcheck", "--help"], 0, "--seed"),
    (["generate", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["generate", "--max-new-tokens", "x"], 2, "invalid int value: 'x'"),
    (["generate", "--repeats", "0"], 2, "ssm-spec generate: error: --repeats: expected >= 1, got 0"),
    (["generate", "--threads", "0"], 2, "ssm-spec generate: error: --threads: expected >= 1, got 0"),
    (["generate", "--do-sample", "--check"], 2, "--check compares with plain greedy"),
])
def test_help_and_argument_errors_import_neither_torch_nor_transformers(how, argv, status, words):
    proc = _command(how, *argv)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert words in proc.stdout + proc.stderr
    assert not _imported(proc.stderr) & {"torch", "transformers", "triton", "numpy"}


def test_the_lazy_names_are_the_eager_ones():
    """As the command sees them (``sys.argv[0]`` is the script while the package imports): no torch
    at import, every public name on first use, the very objects the modules define, and the ops
    registered once ``ssm_spec.ops`` is used."""
    code = ("import sys\n"
            "sys.argv[0] = '/usr/bin/ssm-spec'\n"
            "import ssm_spec, ssm_spec.hf\n"
            "assert 'torch' not in sys.modules\n"
            "for package in (ssm_spec, ssm_spec.hf):\n"
            "    for name in package.__all__:\n"
            "        getattr(package, name)\n"
            "from ssm_spec.modules import RecoverGatedDeltaNet\n"
            "from ssm_spec.hf.apply import apply_recoverssm\n"
            "assert ssm_spec.RecoverGatedDeltaNet is RecoverGatedDeltaNet\n"
            "assert ssm_spec.hf.apply_recoverssm is apply_recoverssm\n"
            "import torch\n"
            "assert torch.ops.ssm_spec.gdn_verify\n"
            "try:\n"
            "    ssm_spec.no_such_name\n"
            "except AttributeError as exc:\n"
            "    assert 'no_such_name' in str(exc)\n"
            "else:\n"
            "    raise AssertionError('no AttributeError')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_any_other_importer_gets_the_names_and_the_ops_at_import():
    code = ("import sys\n"
            "import ssm_spec\n"
            "assert 'RecoverGatedDeltaNet' in vars(ssm_spec) and 'ops' in vars(ssm_spec)\n"
            "import torch\n"
            "assert torch.ops.ssm_spec.gdn_verify\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
