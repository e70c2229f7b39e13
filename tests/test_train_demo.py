"""The demo-model training script (scripts/train_demo_model.py): its fixed data split and its
smoke mode on CPU, whose checkpoints load offline and decode exactly through the CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_demo_model as tdm  # noqa: E402


def test_stdlib_split_is_fixed_without_test_code():
    train, held = tdm.stdlib_split()
    assert (train, held) == tdm.stdlib_split()  # a function of the paths only
    assert train and held and not set(train) & set(held)
    for rel in train + held:
        parts = rel.split("/")
        assert not tdm.TEST_PARTS & set(parts) and not parts[-1].startswith("test_") and rel.endswith(".py")
        assert not tdm.is_build_generated(parts), rel
    frac = len(held) / (len(train) + len(held))
    assert 0.5 / tdm.HELD_OUT_EVERY < frac < 2.0 / tdm.HELD_OUT_EVERY


def run(argv, timeout=600, env=None):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The smoke run's output, the script's main trained in the test process with the script's
    argv (a subprocess paid 5 s of imports)."""
    out = tmp_path_factory.mktemp("demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["scripts/train_demo_model.py", "--smoke", "--out", str(out), "--device", "cpu"])
        assert tdm.main() == 0
    return out


def test_empty_files_are_their_eos_alone(tmp_path):
    """Many ``__init__.py`` files are empty (the first H200 run stopped on one)."""
    (tmp_path / "__init__.py").write_bytes(b"")
    (tmp_path / "a.py").write_bytes(b"x=1\n")
    got = tdm.load_bytes(tmp_path, ["__init__.py", "a.py", "__init__.py"])
    eos = tdm.EOS_TOKEN_ID
    assert got.tolist() == [eos, *b"x=1\n", eos, eos]


def test_smoke_run_writes_the_pair_and_its_manifest(smoke_run):
    man = json.loads((smoke_run / "demo.json").read_text())
    for name in ("target", "draft"):
        assert (smoke_run / name / "model.safetensors").is_file()
        assert (smoke_run / name / "config.json").is_file()
        assert math.isfinite(man["held_out_bits_per_byte"][name]) and man["held_out_bits_per_byte"][name] > 0
        assert man["parameters"][name] > 0
        assert len(man["loss_curve_bits_per_byte"][name]) == len(man["loss_curve_bits_per_byte"]["step"])
    assert man["smoke"] and man["steps"] == tdm.SMOKE["steps"]
    assert "Python Software Foundation" in man["corpus"]["license"]
    assert not set(man["corpus"]["train_files"]) & set(man["corpus"]["held_out_files"])
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra; the curve is in demo.json either way
        assert (smoke_run / "loss.png").stat().st_size > 0


@pytest.mark.parametrize("named, draft, tokens", [(False, "prompt-lookup", 48), (True, "demo", 12)])
def test_smoke_checkpoints_decode_exactly_through_the_cli(smoke_run, named, draft, tokens):
    """The saved pair loads offline (bf16 safetensors, run in fp32) and the converted model's
    speculative decoding gives plain greedy's tokens, with prompt lookup (the target by path) and
    with the draft (both by the name ``demo``, looked up in ``SSM_SPEC_DEMO_DIR``)."""
    from tests.helpers import run_cli

    model = "demo" if named else str(smoke_run / "target")
    proc = run_cli(["generate", "--model", model, "--draft", draft, "--check", "--max-new-tokens", tokens,
                    "--repeats", "1", "--warmup", "1", "--device", "cpu"], env={"SSM_SPEC_DEMO_DIR": str(smoke_run)})
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-2000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("tokens equal plain greedy"))
    assert line.split()[-1] == "yes", out


def test_bench_hf_generate_model_demo_on_held_out_code(smoke_run, tmp_path):
    """``bench_hf_generate.py --model demo``: continuation and edit prompts from the held-out
    files, every run's tokens equal plain greedy's (fp32), acceptance recorded for both draft
    sources."""
    run(["benchmarks/bench_hf_generate.py", "--device", "cpu", "--quick", "--model", "demo", "--dtype", "float32",
         "--prompt-files", "1", "--prompt-bytes", "256", "--new-tokens", "12", "--warmup-tokens", "4",
         "--out-dir", str(tmp_path)], env={"SSM_SPEC_DEMO_DIR": str(smoke_run)})
    res = json.loads((tmp_path / "hf_generate_demo_float32.json").read_text())
    assert [p["kind"] for p in res["prompts"]] == ["continuation", "edit"]
    assert res["prompts"][0]["file"] in json.loads((smoke_run / "demo.json").read_text())["corpus"]["held_out_files"]
    for name in ("ours", "ours+lookup", "ours+draft"):
        assert res["summary"][name]["tokens_equal_hf"], name
        assert res["summary"][name]["prompts_equal_hf"] == 2 and all(
            p["runs"][name]["first_diff"] is None for p in res["prompts"]), name
    for name in ("ours+lookup", "ours+draft"):
        assert res["summary"][name]["mean_accepted_length_mean"] >= 1.0
        assert all(0.0 <= r <= 1.0 for r in res["summary"][name]["position_rates_mean"])


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], ["--steps", ">= 1, got 0"]),
    (["--steps", "-3"], ["--steps", "got -3"]),
    (["--stdlib", "/nonexistent/stdlib"], ["--stdlib /nonexistent/stdlib", "no such directory"]),
    (["--device", "foo"], ["--device foo"]),
    (["--device", "mps"], ["--device mps", "expected cpu, cuda"]),
    (["--minutes", "inf"], ["--minutes", "finite"]),
    (["--minutes", "0"], ["--minutes", "got 0"]),
    (["--out", "/proc/ssm_spec_demo"], ["--out /proc/ssm_spec_demo", "not writable"]),
])
def test_bad_arguments_are_usage_errors_before_training(tmp_path, capsys, argv, words):
    """``--steps 0`` is not silently the default, nor a negative count a run of no steps; a
    missing corpus or a bad device is one line, not a traceback after setup."""
    with pytest.raises(SystemExit) as exc:
        tdm.parse(["--smoke", "--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("train_demo_model.py: error: ") and all(w in line for w in words), line


def test_out_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(SystemExit):
            tdm.parse(["--smoke", "--out", str(out)])
        assert "exists and is not a directory" in capsys.readouterr().err


def test_a_corpus_too_small_to_split_or_window_is_one_line(tmp_path, capsys):
    """A ``--stdlib`` with no held-out file, or whose held-out files are shorter than one
    window, stops before any model is built (not ``torch.cat`` of nothing, nor 0 bits per byte)."""
    corpus = tmp_path / "lib"
    corpus.mkdir()
    (corpus / "a.py").write_text("x = 1\n")
    assert tdm.main(["--smoke", "--stdlib", str(corpus), "--out", str(tmp_path / "o")]) == 2
    assert "0 held-out .py files" in capsys.readouterr().err
    for name in "bcdefghijklmnopqrstuvwxyz":
        (corpus / f"{name}.py").write_text("x = 1\n")
    assert tdm.stdlib_split(corpus)[1]  # now something is held out, but it is a few bytes
    assert tdm.main(["--smoke", "--stdlib", str(corpus), "--out", str(tmp_path / "o")]) == 2
    assert "fewer than a window" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_short_run_still_trains(tmp_path):
    """``--steps 1`` clamps the warm-up (a step at learning rate 0 trains nothing)."""
    out = tmp_path / "short"
    assert tdm.main(["--smoke", "--steps", "1", "--out", str(out), "--device", "cpu"]) == 0
    man = json.loads((out / "demo.json").read_text())
    assert man["steps"] == 1 and man["warmup"] == 0


def test_demo_divergence_names_the_first_different_token_and_its_gaps(monkeypatch):
    """Where a run's tokens part from plain greedy's, the record names the first new token that
    differs, both tokens and the unconverted target's gaps at that position (the logits row
    before it), so a bf16 near-tie reads apart from a bug; a run that stops early is a
    difference without gaps."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from hf_demo import divergence

    logits = torch.zeros(3 + 4, 10)
    logits[3 + 1 - 1, 7], logits[3 + 1 - 1, 2] = 5.0, 4.5  # new token 1 is predicted from position 3 + 0
    assert divergence([1, 7, 3], [1, 7, 3], logits, 3) == {"tokens_equal_hf": True, "first_diff": None}
    d = divergence([1, 2, 3], [1, 7, 3], logits, 3)
    assert (d["first_diff"], d["token_hf"], d["token_run"]) == (1, 7, 2)
    assert d["top1_minus_top2"] == 0.5 and d["logit_a_minus_b"] == 0.5 and d["top1_token"] == 7
    assert divergence([1, 7], [1, 7, 3], logits, 3) == {"tokens_equal_hf": False, "first_diff": 2}


def test_demo_summary_and_table_take_a_run_that_only_ends_early(monkeypatch, capsys):
    """A prompt whose run differs from hf's only in length (an early end of sequence) counts as
    not equal but has no gaps: the summary's largest gap comes from the token differences alone
    and the printed table names only those."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from hf_demo import divergence, print_demo, summarize_runs

    logits = torch.zeros(2 + 3, 10)
    logits[2, 7], logits[2, 2] = 3.0, 2.75  # new token 1 is predicted from position 2 + 0
    plain = [1, 7, 3]
    runs = [[1, 2, 3], [1, 7]]  # prompt 0 parts at token 1; prompt 1 ends early
    rows = []
    for i, run in enumerate(runs):
        rows.append({"file": f"f{i}", "kind": "code", "runs": {
            "hf": {"tokens_per_s": 10.0 + i, "tokens_equal_hf": True},
            "ours+lookup": {"tokens_per_s": 20.0 + 2 * i, "mean_accepted_length": 2.0 + i,
                            "position_rates": [0.5] * (i + 1), **divergence(run, plain, logits, 2)}}})
    summary = summarize_runs(rows)
    s = summary["ours+lookup"]
    assert s["prompts_equal_hf"] == 0 and not s["tokens_equal_hf"]
    assert s["largest_top1_minus_top2_at_first_diff"] == 0.25
    assert s["speedup_over_hf"] == 21.0 / 10.5 and s["position_rates_mean"] == [0.5, 0.25]
    rows[0]["runs"]["ours+lookup"] = {**rows[0]["runs"]["ours+lookup"], **divergence(plain, plain, logits, 2)}
    rows[0]["runs"]["ours+lookup"].pop("top1_minus_top2")
    assert summarize_runs(rows)["ours+lookup"]["largest_top1_minus_top2_at_first_diff"] is None
    print_demo({"model": "m", "draft": "d", "dtype": "float32", "device": "cpu", "new_tokens": 3,
                "num_draft_tokens": 2, "prompts": rows, "summary": summary})
    out = capsys.readouterr().out
    assert "ours+lookup" in out and "0/2" in out and "prompt 1" not in out


def test_results_record_a_checkpoint_inside_the_repository_by_its_relative_path(tmp_path, monkeypatch):
    """Committed demo JSON must not carry the absolute paths of the machine that ran it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from hf_demo import recorded_path

    assert recorded_path(ROOT / "ssm_spec" / "assets" / "demo" / "target") == "ssm_spec/assets/demo/target"
    assert recorded_path(tmp_path / "target") == str(tmp_path / "target")  # elsewhere: as given
