"""Run tests/interpret/ (the Triton kernels on CPU tensors) in its own process with
TRITON_INTERPRET=1 set before anything imports Triton.

The process is started as soon as collection has finished (``conftest.pytest_collection_finish``
calls :func:`start_interpreter_suite` when this test is selected), so it runs beside the rest of
the suite on its own core instead of after it: it is single-threaded Python for most of its
4-8 minutes on a 2-core machine. The test waits for it and reports its output on failure."""

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200
_RUN: dict = {}


def _die_with_parent() -> None:
    """Linux: the interpreter process gets SIGTERM when the session's process dies, however it
    dies (a SIGTERM to pytest runs no session-finish hook)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_interpreter_suite() -> None:
    """Start the interpreter process once (a no-op if it runs already or Triton is missing)."""
    if _RUN or os.environ.get("TRITON_INTERPRET") == "1" or importlib.util.find_spec("triton") is None:
        return
    # one thread for its torch and numpy: the main session keeps the machine's other core(s)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "interpret")],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    _RUN.update(proc=proc, log=log, started=time.monotonic())


def stop_interpreter_suite() -> None:
    """Kill the interpreter process if the session ends before the test collected it."""
    proc = _RUN.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already the interpreter process")
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    start_interpreter_suite()  # run alone (pytest tests/test_triton_interpret.py): start it now
    proc, log = _RUN["proc"], _RUN["log"]
    try:
        proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - _RUN["started"])))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.seek(0)
    out = log.read()
    assert proc.returncode == 0, out[-9000:]
    assert " passed" in out and "failed" not in out.strip().splitlines()[-1], out[-3000:]
