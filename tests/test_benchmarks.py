"""The benchmark scripts run (CPU smoke mode: tiny widths; the numbers mean nothing here), as
``benchmarks/README.md`` documents them, and never touch the committed results."""

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"

#: Appended to a documented smoke command to keep the test short; none of them says where the
#: results go, so the command's own output place is what the test checks.
CHEAPER = {
    "bench_hf_generate.py": ["--new-tokens", "4", "--warmup-tokens", "4", "--repeats", "1",
                             "--forward-reps", "1", "--forward-warmup", "0", "--no-hf-torch",
                             "--prompt-repeats", "1", "--no-graphs"],
    "bench_hf_tp.py": ["--new-tokens", "16", "--warmup-tokens", "4", "--repeats", "1"],
}


def documented_cpu_smoke_commands() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``({script: argv}, {script: launcher argv})`` for each ``python benchmarks/<script> ...
    --device cpu ...`` or ``torchrun --nproc-per-node N benchmarks/<script> ... --device cpu ...``
    line in benchmarks/README.md's code blocks (the comment after ``#`` dropped). The launcher is
    ``[python]`` or ``[python, -m, torch.distributed.run, --standalone, --nproc-per-node, N]``
    (``--standalone``: a free rendezvous port, so parallel runs do not collide)."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    commands, launchers = {}, {}
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            m = re.match(r"(python|torchrun --nproc-per-node (\d+)) benchmarks/(bench_\w+\.py)\b([^#]*)", line.strip())
            if m and "--device cpu" in m.group(4):
                commands[m.group(3)] = shlex.split(m.group(4))
                launchers[m.group(3)] = [sys.executable] + (
                    ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", m.group(2)] if m.group(2) else [])
    return commands, launchers


COMMANDS, LAUNCHERS = documented_cpu_smoke_commands()


def test_every_benchmark_documents_a_cpu_smoke_command():
    assert set(COMMANDS) == {"bench_ops.py", "bench_step.py", "bench_hf_generate.py", "bench_step_tp.py",
                             "bench_hf_tp.py"}, COMMANDS
    assert LAUNCHERS["bench_step_tp.py"][-2:] == LAUNCHERS["bench_hf_tp.py"][-2:] == ["--nproc-per-node", "2"]


def git_status_results() -> str | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    proc = subprocess.run(["git", "status", "--porcelain", "--ignored", RESULTS], cwd=ROOT,
                          capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def run_documented(script: str) -> Path:
    """Run the README's CPU smoke command for ``script`` from the repository root (as
    documented); check that ``git status`` of benchmarks/results is unchanged and return the
    JSON file the run says it wrote."""
    before = git_status_results()
    if before is None:
        pytest.skip("not a git checkout")
    argv = [*LAUNCHERS[script], f"benchmarks/{script}", *COMMANDS[script], *CHEAPER.get(script, [])]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert git_status_results() == before, "a smoke run changed benchmarks/results"
    assert re.search(r"^results go to .*git-ignored", proc.stdout, flags=re.M), proc.stdout[-2000:]
    (json_path,) = re.findall(r"^wrote (.*\.json)$", proc.stdout, flags=re.M)
    json_path = Path(json_path)
    assert (ROOT / RESULTS).resolve() not in json_path.resolve().parents
    return json_path


def test_bench_step_smoke_run():
    res = json.loads(run_documented("bench_step.py").read_text())
    modes = {r["mode"] for r in res["rows"]}
    assert modes == {"recoverssm", "snapshot", "folded", "fast", "lazy"}
    # the fixed acceptance pattern gives every mode the same tokens per step
    for k in res["config"]["k"]:
        for B in res["config"]["batches"]:
            per_mode = {r["mode"]: r["tokens_per_step"] for r in res["rows"] if r["k"] == k and r["batch"] == B}
            assert len(set(per_mode.values())) == 1, per_mode


def test_bench_step_tp_smoke_run_and_merge(tmp_path):
    """``torchrun --nproc-per-node 2`` (gloo, tiny widths, eager): rank 0 writes the TP 2 JSON
    (both modes, every batch, each rank's time, the same tokens per step in both modes); with a
    TP 1 run (plain ``python``) beside it, ``--merge`` gives the TP-2 / TP-1 ratio of every cell
    and a plot; ``--save`` of a smoke merge is refused."""
    res = json.loads(run_documented("bench_step_tp.py").read_text())
    assert res["tp"] == 2 and res["backend"] == "gloo" and res["config"]["quick"]
    assert {r["mode"] for r in res["rows"]} == {"recoverssm", "folded"}
    assert {r["batch"] for r in res["rows"]} == set(res["config"]["batches"])
    assert all(len(r["step_ms_ranks"]) == 2 and r["step_ms"] == max(r["step_ms_ranks"]) for r in res["rows"])
    for B in res["config"]["batches"]:
        assert len({r["tokens_per_step"] for r in res["rows"] if r["batch"] == B}) == 1
    (tmp_path / res_name(res)).write_text(json.dumps(res))
    one = [sys.executable, "benchmarks/bench_step_tp.py", "--device", "cpu", "--out-dir", str(tmp_path)]
    proc = subprocess.run(one, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    merge = [sys.executable, "benchmarks/bench_step_tp.py", "--merge", str(tmp_path), "--out-dir", str(tmp_path)]
    proc = subprocess.run(merge, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    merged = json.loads((tmp_path / "bench_step_tp_quick_float32.json").read_text())
    assert merged["tp_sizes"] == [1, 2]
    for r in merged["rows"]:
        assert r["over_tp1"] == (1.0 if r["tp"] == 1 else pytest.approx(r["step_ms"] / next(
            b["step_ms"] for b in merged["rows"] if b["tp"] == 1 and (b["mode"], b["batch"]) == (r["mode"], r["batch"]))))
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "bench_step_tp_quick_float32.png").stat().st_size > 0
    proc = subprocess.run([*merge[:-2], "--save"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--save" in proc.stderr.splitlines()[-1], proc.stderr


@pytest.mark.parametrize("script", ["bench_step", "bench_step_tp"])
@pytest.mark.parametrize("argv,words", [
    (["--batches", "0"], "integers >= 1"), (["--batches", "1,0"], "integers >= 1"), (["--k", "-1"], "integers >= 1"),
    (["--steps", "0"], "--steps must be >= 1"), (["--warmup", "-1"], "--steps must be >= 1"),
    (["--prompt-len", "-5"], "--steps must be >= 1"), (["--alpha", "1.5"], "in [0, 1]"),
    (["--modes", "recoverssm,bogus"], "unknown ['bogus']"), (["--device", "bogus"], "--device bogus"),
    (["--device", "cpu:0", "--save"], "--save writes the committed results"),
])
def test_step_benchmarks_refuse_bad_arguments(script, argv, words, capsys):
    """Every bad value is a usage error (exit status 2) before anything is built, and any spelling
    of the CPU makes a smoke run that may not write the committed results."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = __import__(script)
    with pytest.raises(SystemExit) as exc:
        module.parse_args(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_step_tp_merge_refuses_runs_of_other_settings(tmp_path, capsys):
    """``--merge`` compares one setting: runs that differ in anything but the TP size (here the
    acceptance rate) are refused naming the files and the setting; an unreadable JSON is named."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_step_tp

    config = {"state_dtype": "float32", "quick": True, "alpha": 0.7, "k": [3]}
    rows = [{"mode": "folded", "k": 3, "batch": 1, "step_ms": 1.0}]
    for tp, alpha in ((1, 0.7), (2, 0.0)):
        run = {"tp": tp, "device": "cpu", "rows": rows, "config": {**config, "alpha": alpha}}
        (tmp_path / f"bench_step_tp{tp}_quick_float32.json").write_text(json.dumps(run))
    with pytest.raises(SystemExit) as exc:
        bench_step_tp.parse_args(["--merge", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "differ in alpha" in err and "bench_step_tp2_quick_float32.json" in err
    (tmp_path / "bench_step_tp2_quick_float32.json").write_text("{not json")
    with pytest.raises(SystemExit):
        bench_step_tp.parse_args(["--merge", str(tmp_path)])
    assert "bench_step_tp2_quick_float32.json" in capsys.readouterr().err


def res_name(res: dict) -> str:
    return f"bench_step_tp{res['tp']}_quick_{res['config']['state_dtype']}.json"


def test_bench_hf_tp_smoke_run():
    """``torchrun --nproc-per-node 2`` (gloo, tiny widths, fp32): both ranks' greedy tokens, plain
    and with prompt lookup, equal rank 0's unsharded reference, each rank holding half the heads."""
    pytest.importorskip("transformers")
    res = json.loads(run_documented("bench_hf_tp.py").read_text())
    assert res["tp"] == 2 and res["config"]["dtype"] == "float32" and res["config"]["quick"]
    assert res["equal_to_tp1"] == {"plain": [True, True], "lookup": [True, True]} and res["ranks_agree"]
    assert res["config"]["value_heads_per_rank"] * 2 == res["config"]["linear_num_value_heads"]
    assert len(res["tpN"]["plain"]["tokens"]) == res["config"]["new_tokens"]
    assert res["tpN"]["lookup"]["tokens_per_s"] > 0 and res["tp1"]["lookup"]["tokens_per_s"] > 0


def test_bench_ops_smoke_run():
    res = json.loads(run_documented("bench_ops.py").read_text())
    kernels = set(res["rows"][0]["kernels"])
    assert {"verify", "commit_nW", "commit_n1", "snapshot", "folded"} <= kernels
    assert 0 < res["record_bytes_per_token_over_state"] < 1


def test_bench_hf_generate_smoke_run():
    path = run_documented("bench_hf_generate.py")
    res = json.loads(path.read_text())
    assert res["config"]["quick"]
    assert not path.with_suffix(".partial.json").exists()  # the whole result replaced it


def test_bench_hf_generate_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """A run that ends before its JSON (here: interrupted in the agreement step, after every timed
    row) has left each row's tokens/s and the loop's section in ``<name>.partial.json``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_hf_generate as bench
    import hf_runs

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_runs, "token_agreement", cut)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--device", "cpu", "--quick", "--out-dir", str(tmp_path), *CHEAPER["bench_hf_generate.py"]])
    stem = bench.result_name("qwen3_next", "bfloat16")
    assert not (tmp_path / f"{stem}.json").exists()
    partial = json.loads((tmp_path / f"{stem}.partial.json").read_text())
    assert partial["partial"] and partial["config"]["kind"] == "qwen3_next"
    assert {"hf", "ours", "ours+lookup", "loop", "loop+lookup"} <= set(partial["tokens_per_s"])
    assert all(v > 0 for v in partial["tokens_per_s"].values())
    assert partial["loop"]["by_batch"]["1"]["loop_tokens_per_s"] == partial["tokens_per_s"]["loop"]


def test_bench_hf_generate_loop_only_runs_the_baselines_and_the_loop_alone(tmp_path, monkeypatch, capsys):
    """``--loop-only`` on random weights: transformers' baselines and the decode loop's runs, each
    compared with ``hf`` token for token; transformers' loop on the converted model and its single
    forwards are not run, and the table says why."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_hf_generate as bench

    res = bench.main(["--device", "cpu", "--quick", "--loop-only", "--skip", "hf_static", "--out-dir", str(tmp_path),
                      *CHEAPER["bench_hf_generate.py"]])
    assert set(res["tokens_per_s"]) == {"hf", "hf_lookup", "loop", "loop+lookup"}
    assert res["config"]["loop_only"] and res["forwards"]["ours"] is None and res["acceptance"] is None
    assert res["speedup_ours_over_hf"] is None
    assert set(res["agreement"]) == {"hf vs hf_lookup", "hf vs loop", "hf vs loop+lookup", "loop vs loop+lookup"}
    out = capsys.readouterr().out
    assert "ours          | skipped (--loop-only)" in out and "graphs+lookup | skipped (--loop-only)" in out
    assert json.loads((tmp_path / f"{bench.result_name('qwen3_next', 'bfloat16')}.json").read_text())["config"]["loop_only"]


def _refused(script, argv, capsys, monkeypatch) -> str:
    """``python benchmarks/SCRIPT ARGV`` run in this process (its ``main``, from the repository
    root, as the subprocess the smoke runs above start: a usage error exits before anything is
    imported or run that the script's own imports have not already run): exit status 2; returns
    the last stderr line. In-process because each subprocess paid 4-7 s of imports for it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("script", ["bench_ops.py", "bench_step.py", "bench_hf_generate.py"])
def test_save_is_refused_for_a_smoke_run(script, capsys, monkeypatch):
    argv = ["--device", "cpu", "--quick", "--save"] if script != "bench_ops.py" else ["--device", "cpu", "--save"]
    assert "--save" in _refused(script, argv, capsys, monkeypatch)


@pytest.mark.parametrize("script", ["bench_ops.py", "bench_step.py", "bench_hf_generate.py"])
def test_smoke_run_cannot_write_into_the_committed_results_by_out_dir(script, capsys, monkeypatch):
    """``--out-dir`` inside ``benchmarks/results/`` (the folder or below it) is refused for a smoke
    run as ``--save`` is, before anything runs: nothing is written there."""
    before = sorted(p.name for p in (ROOT / RESULTS).rglob("*"))
    for target in (RESULTS, f"{RESULTS}/demo_cpu"):
        argv = ["--device", "cpu", "--out-dir", target]
        if script != "bench_ops.py":
            argv.insert(2, "--quick")
        assert "inside the committed results" in _refused(script, argv, capsys, monkeypatch)
    assert sorted(p.name for p in (ROOT / RESULTS).rglob("*")) == before


def test_trained_pair_on_the_cpu_is_a_measurement_not_a_smoke_run(capsys):
    """``--model demo --device cpu`` (the demo pair's CPU numbers) may write the committed
    results; the same run with ``--quick`` may not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_hf_generate as bench
    from ssm_spec.assets import demo_available

    if not demo_available():
        pytest.skip("this build carries no demo pair")
    args = bench.parse_args(["--model", "demo", "--device", "cpu", "--out-dir", f"{ROOT / RESULTS}/demo_cpu"])
    assert args.out_dir == ROOT / RESULTS / "demo_cpu"
    assert "inside the committed results" in _bench_hf_parse(["--model", "demo", "--out-dir", str(ROOT / RESULTS)],
                                                              capsys)


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"])
def test_bench_hf_generate_runs_every_published_class(tmp_path, kind):
    """The expert and vision-language kinds run the whole benchmark (CPU, tiny widths) and name
    their results ``hf_generate_<kind>_<dtype>``; the expert kinds record their expert widths."""
    argv = [sys.executable, "benchmarks/bench_hf_generate.py", "--device", "cpu", "--quick", "--kind", kind,
            "--out-dir", str(tmp_path), *CHEAPER["bench_hf_generate.py"]]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / f"hf_generate_{kind}_bfloat16.json").read_text())
    assert res["config"]["kind"] == kind and res["speedup_lookup_over_hf"] > 0
    if "moe" in kind:
        assert res["config"]["num_experts"] == 4 and res["config"]["num_experts_per_tok"] == 2


def _bench_hf_parse(argv, capsys):
    """``bench_hf_generate.parse_args(argv)``'s usage error: its last stderr line (exit status 2)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_hf_generate

    with pytest.raises(SystemExit) as exc:
        bench_hf_generate.parse_args(["--device", "cpu", "--quick", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _saved_pair(root: Path, *, draft=True, manifest=True) -> Path:
    """A stand-in training run's output (config and an empty weights file per member)."""
    for name in ("target", "draft") if draft else ("target",):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
        (root / name / "model.safetensors").write_bytes(b"")
    if manifest:
        (root / "demo.json").write_text(json.dumps({"corpus": {"held_out_files": ["base64.py"]}}))
    return root


def _qwen3_5_config(root: Path) -> Path:
    """``root``'s target given a tiny Qwen3.5 config (no MTP layer count)."""
    from ssm_spec.hf.tiny import tiny_config

    tiny_config("qwen3_5").save_pretrained(root / "target")
    return root


@pytest.mark.parametrize("case, words", [
    ("missing", ["--model", "no such directory"]),
    ("run dir", ["training run's output directory", "target"]),
    ("no draft", ["no draft beside it", "--draft PATH"]),
    ("no manifest", ["no training manifest", "demo.json"]),
    ("draft without model", ["--draft needs --model"]),
    ("no prompt files", ["--prompt-files"]),
    ("mtp-k without model", ["--mtp-k needs --model"]),
    ("loop-only without loop", ["--loop-only and --no-loop"]),
    ("mtp-k 0", ["--mtp-k", ">= 1"]),
    ("no mtp head", ["--mtp-k", "cannot draft with an MTP head", "mtp_num_hidden_layers"]),
])
def test_bench_hf_generate_model_is_checked_before_anything_loads(tmp_path, capsys, case, words):
    """``--model PATH`` that is not a training run's target with its draft and ``demo.json``, or
    options that do not fit it, are one usage line (exit status 2) from the argument parser."""
    argv = {"missing": lambda: ["--model", str(tmp_path / "nowhere")],
            "run dir": lambda: ["--model", str(_saved_pair(tmp_path))],
            "no draft": lambda: ["--model", str(_saved_pair(tmp_path, draft=False) / "target")],
            "no manifest": lambda: ["--model", str(_saved_pair(tmp_path, manifest=False) / "target")],
            "draft without model": lambda: ["--draft", str(tmp_path)],
            "no prompt files": lambda: ["--model", str(_saved_pair(tmp_path) / "target"), "--prompt-files", "0"],
            "mtp-k without model": lambda: ["--mtp-k", "3"],
            "loop-only without loop": lambda: ["--loop-only", "--no-loop"],
            "mtp-k 0": lambda: ["--model", str(_saved_pair(tmp_path) / "target"), "--mtp-k", "0"],
            "no mtp head": lambda: ["--model", str(_qwen3_5_config(_saved_pair(tmp_path)) / "target"), "--mtp-k", "2"],
            }[case]()
    line = _bench_hf_parse(argv, capsys)
    assert ": error: " in line, line
    for word in words:
        assert word in line, line


def test_timing_spread_warns_when_timed_calls_disagree(capsys):
    """A run whose timed calls differ by more than the limit is named on stderr (the H200 case:
    12.7 s then 2.8 s after a short warm-up); close calls pass quietly; nonsense is refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from timing import TIMING_SPREAD_LIMIT, timing_spread

    assert timing_spread("hf", [12.727, 2.831]) == pytest.approx(12.727 / 2.831)
    err = capsys.readouterr().err
    assert "hf: timed calls differ 4.50x" in err and "--warmup-tokens" in err
    assert timing_spread("ours", [1.0, 1.0 * TIMING_SPREAD_LIMIT]) == pytest.approx(TIMING_SPREAD_LIMIT)
    assert timing_spread("one call", [2.5]) == 1.0
    assert capsys.readouterr().err == ""
    for bad in ([], [0.0, 1.0], [-1.0], [float("nan")], [1.0, float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="positive, finite seconds"):
            timing_spread("bad", bad)


@pytest.mark.parametrize("cuda", [False, True])
def test_bench_hf_generate_warms_up_over_the_whole_length_where_kernels_compile(monkeypatch, cuda):
    """The default warm-up is the whole generation (``--new-tokens``) for the random-weight kinds
    everywhere and for the trained pair on CUDA; only the trained pair on the CPU (nothing to
    compile) keeps the short one. An explicit ``--warmup-tokens`` is kept."""
    pytest.importorskip("safetensors")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_hf_generate as bench
    from ssm_spec.assets import demo_available

    if not demo_available():
        pytest.skip("this build carries no demo pair")
    device = "cuda" if cuda else "cpu"
    if cuda and not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    demo = bench.parse_args(["--model", "demo", "--device", device, "--new-tokens", "64"])
    assert demo.warmup_tokens == (64 if cuda else bench.DEMO_WARMUP_TOKENS)
    assert bench.parse_args(["--kind", "qwen3_5", "--device", device, "--new-tokens", "64"]).warmup_tokens == 64
    assert bench.parse_args(["--model", "demo", "--device", device, "--warmup-tokens", "5"]).warmup_tokens == 5


def test_bench_hf_tp_refuses_heads_the_ranks_cannot_share(monkeypatch, capsys):
    """Under ``torchrun`` with 3 ranks the tiny model's 2 key heads cannot be shared: a usage
    error (exit status 2) before rank 0 builds its reference model."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_hf_tp

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as exc:
        bench_hf_tp.parse_args(["--quick", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "is not divisible by the 3 ranks" in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert bench_hf_tp.parse_args(["--quick", "--device", "cpu"]).key_heads % 2 == 0


def test_offline_sass_counts_each_loop_of_the_closed_form_kernel(capsys, monkeypatch):
    """``scripts/offline_sass.py`` (no GPU: Triton's own sm_90 compiler): the loop finder takes
    a backward branch's range, innermost first, on a hand-written listing; the real ring kernel
    at L=8, W=2 (PP = 8: the fold by blocks of 4 records) compiles and shows four loops: the
    block loop (a rank-4 update: 4 records x 4 rows x 4 values per lane = 64 FMAs) inside the
    chunk loop, and after it the history's key products and its record loop."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import offline_sass

    listing = "\n".join(f"        /*{a:04x}*/                   {op} ;" for a, op in [
        (0x00, "MOV R1, c[0x0][0x28]"), (0x10, "FFMA R2, R3, R4, R2"), (0x20, "LDG.E R5, [R6.64]"),
        (0x30, "FFMA R2, R5, R4, R2"), (0x40, "@P0 BRA 0x20"), (0x50, "@!P1 BRA 0x10"), (0x60, "EXIT")])
    assert [(a, b, n) for a, b, n, _ in offline_sass.summary(listing)["loops"]] == [(0x20, 0x40, 3), (0x10, 0x50, 5)]
    assert offline_sass.summary(listing)["instructions"] == 7
    assert offline_sass.main(["--window", "2", "--max-pending", "8"]) == 0
    out = capsys.readouterr().out
    assert "ring L=8, W=2 (WP=2, PP=8, KC=8, STAGES=1, PREFETCH=0)" in out, out
    found = [tuple(int(x, 16) for x in re.match(r"loop (0x\w+)-(0x\w+)", ln).groups()) + (ln,)
             for ln in out.splitlines() if ln.startswith("loop")]
    assert len(found) == 4, out
    nested = [(a, b) for a, b, _ in found if any(c < a and b < d for c, d, _ in found)]
    assert len(nested) == 1, out  # the block loop, inside the chunk loop
    block = next(ln for a, b, ln in found if (a, b) == nested[0])
    # a block of 4 records on KC = 8 rows of a 128-wide V tile, one warp: 8 * 4 * 128 / 32 FMAs a lane
    assert re.search(r"FFMA 128\b", block), block


def test_tune_closed_form_reads_its_sweep_flags(capsys):
    """``scripts/tune_closed_form.py``'s sweep flags parse to the lists the sweep walks, and a
    prefetch other than 0/1 is a usage error (it once ran silently as 1)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tune_closed_form as tune

    args = tune.parse(["--prefetch", "0,1", "--plain-key-rows", "4,8", "--ring-key-rows", "8", "--stages", "1"])
    assert (args.prefetch, args.plain_key_rows, args.ring_key_rows, args.stages) == ([0, 1], [4, 8], [8], [1])
    for bad in ("2", "0,-1"):
        with pytest.raises(SystemExit) as exc:
            tune.parse(["--prefetch", bad])
        assert exc.value.code == 2 and "--prefetch" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("setting, want", [("off", False), ("on", True), ("auto", "auto")])
def test_bench_hf_generate_demo_runs_convert_with_the_compile_option(monkeypatch, tmp_path, setting, want):
    """``--model demo --compile off|on|auto`` reaches the conversion of the demo's loop runs."""
    pytest.importorskip("safetensors")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_hf_generate as bench
    import hf_demo

    import ssm_spec.hf
    from ssm_spec.assets import demo_available

    if not demo_available():
        pytest.skip("this build carries no demo pair")
    seen = []
    convert = ssm_spec.hf.apply_recoverssm

    class Stop(Exception):
        pass

    def recording(model, **kw):
        if kw.get("decode_loop"):
            seen.append(kw.get("compile"))
            raise Stop
        return convert(model, **kw)

    monkeypatch.setattr(ssm_spec.hf, "apply_recoverssm", recording)
    args = bench.parse_args(["--model", "demo", "--device", "cpu", "--loop-only", "--compile", setting,
                             "--prompt-files", "1", "--new-tokens", "2", "--warmup-tokens", "1", "--repeats", "1",
                             "--out-dir", str(tmp_path)])
    with pytest.raises(Stop):
        hf_demo.run_demo(args)
    assert seen == [want]


def test_bench_hf_generate_demo_cut_short_keeps_and_prints_the_rows_it_measured(monkeypatch, tmp_path, capsys):
    """``--model demo`` interrupted after its timed runs (here: in the summary) has printed each
    run's tokens/s and left the per-prompt rows in ``hf_generate_demo_<dtype>.partial.json``."""
    pytest.importorskip("safetensors")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_hf_generate as bench
    import hf_demo

    from ssm_spec.assets import demo_available

    if not demo_available():
        pytest.skip("this build carries no demo pair")

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_demo, "summarize_runs", cut)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--model", "demo", "--device", "cpu", "--loop-only", "--prompt-files", "1", "--mtp-k", "1",
                    "--new-tokens", "3", "--warmup-tokens", "1", "--repeats", "1", "--out-dir", str(tmp_path)])
    assert not (tmp_path / "hf_generate_demo_bfloat16.json").exists()
    partial = json.loads((tmp_path / "hf_generate_demo_bfloat16.partial.json").read_text())
    assert partial["partial"] and partial["model"] and len(partial["prompts"]) == 2  # one file: continuation, edit
    names = {"hf", "loop", "loop+lookup", "loop+draft", "loop+mtp k=1"}
    for row in partial["prompts"]:
        assert set(row["runs"]) == names and all(r["tokens_per_s"] > 0 for r in row["runs"].values())
    printed = capsys.readouterr().out
    assert all(f"prompt 1, {name} " in printed for name in names)


def test_round_parts_attributes_a_round_and_leaves_the_loop_as_it_was():
    """benchmarks/round_parts.py on the CPU (operators, not kernels): the profiled call's parts
    include the verify, the append and the commit (and the drafter's for prompt lookup), its
    tokens and those of the loop's next call are the warm-up's, and a call that needs another
    loop than the warm-up's is refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from round_parts import PARTS, round_parts

    from ssm_spec.hf import apply_recoverssm, tiny_model

    model = apply_recoverssm(tiny_model("qwen3_5", seed=3), decode_loop=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    for kw, drafted in (({}, ()), ({"prompt_lookup_num_tokens": 2}, ("draft", "counters"))):
        with torch.no_grad():
            before = model.generate(ids, max_new_tokens=12, do_sample=False, **kw)
        res = round_parts(model, ids, kw, 12, rounds=2, skip=1)
        assert torch.equal(res["sequences"], before)
        assert "_rounds" not in vars(model._recoverssm.loop)
        assert set(res["parts"]) <= set(PARTS)
        for part in ("verify", "append", "commit", *drafted):
            assert res["parts"][part]["kernels"] > 0, (kw, part, res["parts"])
        assert res["kernels"] == sum(p["kernels"] for p in res["parts"].values())
        assert res["rounds"] == (2 * 4 if not kw else 2)
        with torch.no_grad():
            assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, **kw), before)
    with pytest.raises(ValueError, match="fewer than"):
        round_parts(model, ids, {"prompt_lookup_num_tokens": 2}, 12, skip=50)
    with pytest.raises(ValueError, match="another decode loop"):  # the warm-up made the lookup call's loop
        round_parts(model, ids, {}, 12)


def test_kernel_breakdown_sorts_a_forwards_kernels_by_kind_and_time():
    """The names a CUDA profile gives (cuBLAS, ssm_spec's Triton kernels, flash attention,
    inductor's fused kernels, a memset) go to their kinds; the top list ranks names by total time."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from forward_timing import kernel_breakdown

    kernels = [("nvjet_tst_64x8_64x16_2x1_v_bz_TNN", 10.0), ("nvjet_tst_64x8_64x16_2x1_v_bz_TNN", 12.0),
               ("gdn_window_kernel", 4.0), ("short_conv_verify_kernel", 1.0), ("flash_fwd_splitkv_kernel", 3.0),
               ("triton_red_fused_add_mean_mul_pow_rsqrt_3", 2.0), ("Memset (Device)", 0.5), ("elementwise_kernel", 1.5)]
    got = kernel_breakdown(kernels, top=2)
    kinds = {kind: v["kernels"] for kind, v in got["by_kind"].items()}
    assert kinds == {"gemm": 2, "ssm_spec op": 2, "attention": 1, "inductor fused": 1, "copy / fill": 1, "other": 1}
    assert abs(got["by_kind"]["gemm"]["ms"] - 0.022) < 1e-12
    assert got["top"] == [["nvjet_tst_64x8_64x16_2x1_v_bz_TNN", 2, 0.022], ["gdn_window_kernel", 1, 0.004]]


def test_use_splitk_swaps_the_narrow_projections_and_back():
    """benchmarks/splitk_gemv.py's ``use_splitk`` on a tiny converted model (the CPU: no tuning,
    the op falls back to ``F.linear``): the GDN ``out_proj``, attention ``o_proj`` and MLP
    ``down_proj`` modules run through the custom op with the same state dict and logits, an MLP
    compiles with it in one graph (``fullgraph=True``), and ``enable=False`` restores the class
    each had (``nn.Linear``, or the converted model's ``NarrowLinear``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from splitk_gemv import SplitKLinear, use_splitk
    from torch import nn

    from ssm_spec.hf import apply_recoverssm, tiny_model
    from ssm_spec.hf.narrow_gemv import NarrowLinear

    model = apply_recoverssm(tiny_model("qwen3_5", seed=0))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = model(ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {n: type(m) for n, m in model.named_modules()}
    names = use_splitk(model)
    suffixes = {n.rsplit(".", 1)[-1] for n in names}
    assert suffixes == {"out_proj", "o_proj", "down_proj"}, names
    assert all(type(model.get_submodule(n)) is SplitKLinear for n in names)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        mlp = model.model.layers[0].mlp
        h = torch.randn(1, 3, model.config.hidden_size)
        assert torch.allclose(torch.compile(mlp, fullgraph=True)(h), mlp(h), atol=1e-6)  # the op traces
    assert model.state_dict().keys() == before.keys()
    use_splitk(model, enable=False)
    assert {n: type(model.get_submodule(n)) for n in names} == {n: classes[n] for n in names}
    assert {classes[n] for n in names} == {nn.Linear, NarrowLinear}  # ssm_spec's own swap kept
