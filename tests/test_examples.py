"""The examples run and check themselves."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_qwen_fork_speculative_tokens_equal_greedy(capsys):
    example = _load("custom_qwen_fork")
    assert example.main(["--tokens", "40", "--k", "3", "--seed", "3"]) == 0
    assert "identical  : True" in capsys.readouterr().out


def test_hf_assisted_generate_example_equals_plain_greedy(capsys):
    example = _load("hf_assisted_generate")
    assert example.main([]) == 0
    assert "equal plain greedy: True" in capsys.readouterr().out


def test_compile_graph_capture_example_runs(capsys):
    example = _load("compile_graph_capture")
    assert example.main(["--quick", "--device", "cpu", "--batch", "1", "3"]) == 0
    out = capsys.readouterr().out
    assert "eager ms" in out and "captured 0 bucket(s)" in out


def test_tensorrt_verify_example_exports_and_commits(capsys):
    example = _load("tensorrt_verify")
    assert example.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "exported program == eager on another batch shape: True" in out
    assert "ssm_spec.gdn_verify_functional.default" in out


def test_tensor_parallel_example_under_torchrun():
    """docs/multi-gpu.md's launch line, two CPU ranks over gloo (loopback), bounded in time, exiting
    cleanly (the example ends its group before the interpreter's exit: docs/multi-gpu.md)."""
    import socket
    import subprocess
    import sys

    def launch():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(ROOT / "examples" / "tensor_parallel.py"),
                               "--steps", "8"], capture_output=True, text=True, timeout=120, cwd=ROOT)

    proc = launch()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in (0, 1):
        assert f"rank {r}/2: value heads" in proc.stdout
