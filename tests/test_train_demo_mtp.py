"""The demo target's MTP-head training script (scripts/train_demo_mtp.py): the unrolled head it
trains is the decode loop's drafter step for step, its smoke run on CPU writes the head under the
published names beside the target's own tensors (never into the package's assets), a separate
``--install`` puts it there, and the benchmark's ``loop+mtp`` rows run on what it wrote."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from ssm_spec.assets import demo_available  # noqa: E402
from ssm_spec.hf import apply_recoverssm  # noqa: E402
from ssm_spec.hf.mtp import load_mtp_head  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_demo_mtp as tdm_mtp  # noqa: E402

ASSETS = tdm_mtp.ASSETS_DEMO


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(argv, timeout=600):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


# ---------------------------------------------------------------------------------------- the unrolled head
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_unrolled_head_is_the_decode_loops_drafter(attn, tmp_path, monkeypatch):
    """Every round of ``generate(use_mtp=True, num_assistant_tokens=3)`` on left-padded rows, the
    acceptance forced to every count 0..3 (every rollback length): each row's draft logits are the
    training's ``unrolled`` steps on that row alone (its tokens up to the last kept one, then the
    drafts fed back), from the unconverted target's hidden states after its final norm."""
    from tests.hf.test_mtp import TEXTS, _batch, _forced_acceptance, write_checkpoint

    from ssm_spec.hf.loop import mtp as mtp_module
    from ssm_spec.hf.loop import runner

    write_checkpoint(tmp_path, "qwen3_5", seed=3)
    model = apply_recoverssm(transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, attn_implementation=attn))
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, attn_implementation=attn).eval()
    head = load_mtp_head(ref)
    records, propose = [], mtp_module.MTPDrafter.propose

    def recording(self, rows):
        seen, lm_head = [], self.lm_head
        self.lm_head = lambda g: seen.append(lm_head(g)) or seen[-1]
        try:
            drafts, count, probs = propose(self, rows)
        finally:
            self.lm_head = lm_head
        records.append((rows.tokens.clone(), (rows.start + rows.produced - 1).clone(), rows.pad.clone(),
                        rows.finished.clone(), drafts.clone(), torch.stack(seen, 1)))
        return drafts, count, probs

    counter = [0]
    monkeypatch.setattr(mtp_module.MTPDrafter, "propose", recording)
    monkeypatch.setattr(runner, "accept_greedy", _forced_acceptance(counter))
    ids, mask = _batch(TEXTS)
    k = 3
    model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, use_mtp=True, num_assistant_tokens=k)
    checked = 0
    for tokens, last, pad, finished, drafts, logits in records:
        for b in range(len(TEXTS)):
            if finished[b]:
                continue
            seq = tokens[b, pad[b]:last[b] + 1]
            x = torch.cat([seq, drafts[b]])[None]
            with torch.no_grad():
                hidden, _ = tdm_mtp.target_pass(ref, x)
                outs = tdm_mtp.unrolled(head, ref, hidden, x, k)
                t = len(seq) - 2  # the anchor: the pair (h[L - 1], x[L]) of the last kept token x[L]
                want = torch.stack([ref.lm_head(g[0, t]) for g in outs])
            err = float((logits[b] - want).abs().max() / want.abs().max())
            assert err < 1e-4, (b, int(last[b]), err)
            checked += 1
    assert checked >= 6 and counter[0] == len(records), checked


def test_step_mask_sees_true_pairs_up_to_the_anchor_and_the_chains_own_steps():
    m = tdm_mtp.step_mask(3, 2, "cpu", sdpa=True)[0, 0]
    assert m.tolist() == [[True, False, False, True, False, False],
                          [True, True, False, False, True, False],
                          [True, True, True, False, False, True]]
    additive = tdm_mtp.step_mask(3, 2, "cpu", sdpa=False)[0, 0]
    assert ((additive == 0) == m).all() and (additive[~m] < -1e30).all()


# ---------------------------------------------------------------------------------------- the smoke run
needs_demo = pytest.mark.skipif(not demo_available("target"), reason="this build carries no demo target")


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory):
    if not demo_available("target"):
        pytest.skip("this build carries no demo target")
    out = tmp_path_factory.mktemp("mtp")
    before = {p: _sha(p) for p in (ASSETS / "target").iterdir()}
    with pytest.MonkeyPatch.context() as mp:  # the script's main in the test process (no 5 s of imports), its argv
        mp.setattr(sys, "argv", ["scripts/train_demo_mtp.py", "--smoke", "--out", str(out), "--device", "cpu"])
        assert tdm_mtp.main() == 0
    assert {p: _sha(p) for p in (ASSETS / "target").iterdir()} == before, "a smoke run wrote the package's assets"
    assert not (ASSETS / "mtp.json").exists() or _sha(ASSETS / "mtp.json") != _sha(out / "mtp.json")
    return out


@needs_demo
def test_smoke_run_writes_the_head_beside_the_targets_own_tensors(smoke_out):
    """``OUT/target``: the target's tensors byte for byte, the ``mtp.*`` tensors in bf16 under the
    published names, one MTP layer declared; transformers loads it with nothing unexpected, and
    ``load_mtp_head`` reads the head; the draft and ``demo.json`` beside it make a demo directory."""
    src = ASSETS / "target"
    own = {n: t for n, t in load_file(str(src / "model.safetensors")).items() if not n.startswith("mtp.")}
    got = load_file(str(smoke_out / "target" / "model.safetensors"))
    mtp = {n: t for n, t in got.items() if n.startswith("mtp.")}
    assert {n: t for n, t in got.items() if not n.startswith("mtp.")}.keys() == own.keys()
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in own.items())
    assert mtp and {t.dtype for t in mtp.values()} == {torch.bfloat16}
    config = json.loads((smoke_out / "target" / "config.json").read_text())
    assert config.pop("mtp_num_hidden_layers") == 1
    assert config == {k: v for k, v in json.loads((src / "config.json").read_text()).items()
                      if k != "mtp_num_hidden_layers"}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(smoke_out / "target", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    head = load_mtp_head(model)
    assert {f"mtp.{n}" for n in head.state_dict()} == set(mtp)
    for name in ("draft/config.json", "demo.json", "mtp.json"):
        assert (smoke_out / name).is_file(), name


@needs_demo
def test_smoke_record_reports_acceptance_per_draft_position(smoke_out):
    rec = json.loads((smoke_out / "mtp.json").read_text())
    assert rec["smoke"] and rec["steps"] == tdm_mtp.SMOKE["steps"] and rec["command"].startswith("train_demo_mtp.py")
    assert rec["target"] == "ssm_spec/assets/demo/target"  # relative: no machine's paths in a committed record
    held = rec["held_out"]
    rates, cond, tokens = held["position_rates"], held["conditional_top1"], held["expected_tokens_per_round"]
    assert len(rates) == len(cond) == len(tokens) == tdm_mtp.POSITIONS and held["anchors"] > 0
    assert all(0.0 <= r <= 1.0 for r in rates + cond)
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # drafts 1..j all accepted: no more likely for larger j
    assert tokens == pytest.approx([1 + sum(rates[:k]) for k in range(1, 6)])
    assert len(rec["loss_curve"]["loss"]) == len(rec["loss_curve"]["step"]) > 0
    assert rec["parameters"] == sum(
        t.numel() for n, t in load_file(str(smoke_out / "target" / "model.safetensors")).items() if n.startswith("mtp."))


@needs_demo
def test_install_puts_the_head_into_a_demo_directory_and_refuses_another_target(smoke_out, tmp_path):
    """``--install OUT --into DIR``: DIR's target gains the ``mtp.*`` tensors and the layer count,
    its own tensors unchanged, and ``mtp.json`` beside; a target that is not the one trained on is
    refused with nothing written."""
    into = tmp_path / "demo"
    shutil.copytree(ASSETS, into)
    own = load_file(str(into / "target" / "model.safetensors"))
    tdm_mtp.main(["--install", str(smoke_out), "--into", str(into)])
    got = load_file(str(into / "target" / "model.safetensors"))
    trained = load_file(str(smoke_out / "target" / "model.safetensors"))
    assert got.keys() == trained.keys() and all(torch.equal(got[n], t) for n, t in trained.items())
    assert all(torch.equal(got[n], t) for n, t in own.items() if not n.startswith("mtp."))
    assert json.loads((into / "target" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    assert (into / "mtp.json").read_text() == (smoke_out / "mtp.json").read_text()

    other = tmp_path / "other"
    shutil.copytree(ASSETS, other)
    (other / "mtp.json").unlink(missing_ok=True)  # the shipped demo has a head installed already
    weights = load_file(str(other / "target" / "model.safetensors"))
    name = next(n for n in weights if not n.startswith("mtp."))
    weights[name] = weights[name] + 1
    from safetensors.torch import save_file

    save_file(weights, str(other / "target" / "model.safetensors"), metadata={"format": "pt"})
    before = _sha(other / "target" / "model.safetensors")
    with pytest.raises(ValueError, match="trained on another target"):
        tdm_mtp.install(smoke_out, other)
    assert _sha(other / "target" / "model.safetensors") == before and not (other / "mtp.json").exists()


@needs_demo
def test_bench_hf_generate_runs_loop_mtp_on_the_trained_head(smoke_out, tmp_path):
    """``bench_hf_generate.py --model OUT/target --loop-only --mtp-k 1 2`` (fp32, CPU): the
    ``loop+mtp k=K`` rows and the summary's ``loop+mtp`` (the fastest K) equal plain greedy's
    tokens, with acceptance for every draft position of each K."""
    run(["benchmarks/bench_hf_generate.py", "--device", "cpu", "--quick", "--model", str(smoke_out / "target"),
         "--dtype", "float32", "--prompt-files", "1", "--prompt-bytes", "128", "--new-tokens", "8",
         "--warmup-tokens", "4", "--loop-only", "--mtp-k", "1", "2", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "hf_generate_demo_float32.json").read_text())
    assert set(res["summary"]) == {"hf", "loop", "loop+lookup", "loop+draft", "loop+mtp k=1", "loop+mtp k=2",
                                   "loop+mtp"}
    for k in (1, 2):
        s = res["summary"][f"loop+mtp k={k}"]
        assert s["tokens_equal_hf"] and len(s["position_rates_mean"]) == k, s
        assert res["mtp"]["by_k"][str(k)]["over_loop"] > 0
    best = res["mtp"]["best_k"]
    assert res["summary"]["loop+mtp"]["k"] == best and res["mtp"]["k"] == [1, 2]


@pytest.mark.parametrize("argv, words", [
    ([], ["--out DIR", "--install OUT"]),
    (["--out", "x", "--install", "y"], ["one of them"]),
    (["--out", str(ASSETS)], ["the package's demo directory"]),
    (["--out", "x", "--steps", "0"], ["--steps", "got 0"]),
    (["--out", "x", "--unroll", "0"], ["--unroll"]),
    (["--out", "x", "--target", "/nonexistent/target"], ["--target", "config.json"]),
])
def test_bad_arguments_are_usage_errors_before_training(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        tdm_mtp.parse(argv)
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("train_demo_mtp.py: error: ") and all(w in line for w in words), line


def test_install_of_something_else_is_one_line(tmp_path, capsys):
    assert tdm_mtp.main(["--install", str(tmp_path), "--into", str(tmp_path)]) == 2
    assert "not a training run's output" in capsys.readouterr().err
