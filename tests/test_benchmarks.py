"""The benchmark scripts run (CPU smoke mode: tiny widths; the numbers mean nothing here)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_step_smoke_run_writes_results(tmp_path):
    proc = subprocess.run([sys.executable, "bench_step.py", "--device", "cpu", "--out-dir", str(tmp_path)],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "bench_step_quick_float32.json").read_text())
    modes = {r["mode"] for r in res["rows"]}
    assert modes == {"recoverssm", "snapshot", "folded"}
    # the fixed acceptance pattern gives every mode the same tokens per step
    for k in res["config"]["k"]:
        for B in res["config"]["batches"]:
            per_mode = {r["mode"]: r["tokens_per_step"] for r in res["rows"] if r["k"] == k and r["batch"] == B}
            assert len(set(per_mode.values())) == 1, per_mode


def test_bench_ops_smoke_run_writes_results(tmp_path):
    proc = subprocess.run([sys.executable, "bench_ops.py", "--device", "cpu", "--out-dir", str(tmp_path)],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("bench_ops_*.json")
    res = json.loads(path.read_text())
    kernels = set(res["rows"][0]["kernels"])
    assert {"verify", "commit_nW", "commit_n1", "snapshot", "folded"} <= kernels
    assert 0 < res["record_bytes_per_token_over_state"] < 1
