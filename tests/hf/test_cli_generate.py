"""``ssm-spec generate`` (ssm_spec/hf/cli_generate.py and its cli_* parts): the console script's main job.

The runs go through ``ssm_spec.cli.main`` in the test process (``tests.helpers.run_cli``: the
output captured, what the command sets process-wide put back), which a subprocess paid 5-7 s of
imports for; the default run, a closed stdout and the torch-free parser start ``python -m
ssm_spec`` as a user does. ``OMP_NUM_THREADS=1``: the tiny model's matmuls are microseconds, and
on a busy machine torch's thread pool can make them a hundred times slower.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssm_spec import cli
from ssm_spec.hf import cli_generate, cli_loading
from ssm_spec.hf.cli_generate import RANDOM_WEIGHTS_NOTE, ProgressStreamer, busy_note, length_warning
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _argv(args):
    """``generate ARGS``, on the tiny random model unless ARGS name a ``--model`` (the default,
    the demo model, is tested in tests/hf/test_demo_model.py)."""
    model = [] if "--model" in map(str, args) else ["--model", "tiny-random"]
    return ["generate", *model, *map(str, args)]


def _run(*args, omp_threads="1"):
    """``ssm-spec generate ARGS`` in the test process (:func:`tests.helpers.run_cli`).
    ``omp_threads``: ``$OMP_NUM_THREADS`` (None: unset, the command's own default)."""
    return run_cli(_argv(args), omp_threads=omp_threads)


def _run_process(*args, timeout=300):
    """``python -m ssm_spec generate ARGS`` in a subprocess, as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "ssm_spec", *_argv(args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _row(stdout, name):
    """The value of the table row ``name`` (None when absent)."""
    m = re.search(rf"^{re.escape(name)}\s+(.*)$", stdout, re.MULTILINE)
    return m.group(1) if m else None


TIMED_RUNS = ("plain transformers", "converted, no drafts", "converted, with drafts")


def _tokens_per_s(stdout, run):
    return float(_row(stdout, f"tokens/s, {run}").split()[0])


def _assert_ok_and_equal(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _row(proc.stdout, "tokens equal plain greedy") == "yes", proc.stdout
    for run in TIMED_RUNS:
        assert _tokens_per_s(proc.stdout, run) > 0, proc.stdout


def test_default_run_with_check():
    """The default (tiny model, prompt lookup; on CUDA where present) equals plain greedy and
    prints the table. The other runs pass --device cpu: a fresh process compiles the Triton
    kernels again, which costs more than the tiny model's whole run. A process of its own: the
    command end to end as a user starts it."""
    proc = _run_process("--max-new-tokens", 64, "--check", "--repeats", 1)
    _assert_ok_and_equal(proc)
    assert _row(proc.stdout, "new tokens") == "64"
    assert float(_row(proc.stdout, "mean accepted length").split()[0]) >= 1.0
    assert _row(proc.stdout, "draft").startswith("prompt lookup")
    assert _row(proc.stdout, "acceptance by position") is not None


def test_draft_self_accepts_every_draft():
    """The tiny model as its own assistant: greedy drafts always match, K=5 per round."""
    proc = _run("--max-new-tokens", 48, "--draft", "self", "--check", "--warmup", 0, "--quiet", "--device", "cpu",
                "--repeats", 1)
    _assert_ok_and_equal(proc)
    assert _row(proc.stdout, "acceptance rate").startswith("100.0%")
    assert float(_row(proc.stdout, "mean accepted length").split()[0]) > 5.0  # 5 drafts + 1 per round
    assert proc.stderr == ""  # --quiet: no bars, no notes, no transformers warnings


def test_cuda_graphs_path_on_cpu_with_self_draft():
    """``--cuda-graphs on`` off CUDA runs the graphed forward's body eagerly (static attention
    buffers, kept cache); with the model as its own draft it still equals plain greedy and
    accepts every draft (the assistant's calls never touch the target's kept cache)."""
    proc = _run("--max-new-tokens", 40, "--draft", "self", "--cuda-graphs", "on", "--check", "--warmup", 8,
                "--quiet", "--device", "cpu", "--repeats", 1)
    _assert_ok_and_equal(proc)
    assert _row(proc.stdout, "acceptance rate").startswith("100.0%")


@pytest.mark.hf_one_release  # checked before transformers is imported
def test_missing_model_path_exits_2(tmp_path):
    proc = _run("--model", tmp_path / "nope", "--max-new-tokens", 4)
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "no such directory" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.hf_one_release  # the report's own rows; the CLI's runs on the second release: the --check tests
def test_output_reports_three_timings_and_the_random_weights_note():
    """The table has the three runs' tokens/s (median of --repeats calls), speed-ups that say
    which two runs they divide (and agree with the rows), and the torch thread count; the
    default model's text is preceded by one line saying it is random bytes."""
    proc = _run("--max-new-tokens", 8, "--warmup", 0, "--repeats", 2, "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.splitlines()[0] == RANDOM_WEIGHTS_NOTE
    assert out.count(RANDOM_WEIGHTS_NOTE) == 1
    for run in TIMED_RUNS:
        assert "median of 2 calls" in _row(out, f"tokens/s, {run}"), out
    plain, converted, spec = (_tokens_per_s(out, run) for run in TIMED_RUNS)
    over_hf = _row(out, "speed-up over transformers")
    from_drafts = _row(out, "speed-up from drafts")
    assert "converted, with drafts / tokens/s of plain transformers" in over_hf, out
    assert "converted, with drafts / tokens/s of converted, no drafts" in from_drafts, out
    assert float(over_hf.split("x")[0]) == pytest.approx(spec / plain, rel=0.02, abs=0.01)
    assert float(from_drafts.split("x")[0]) == pytest.approx(spec / converted, rel=0.02, abs=0.01)
    assert re.match(r"1 intra-op, \d+ inter-op", _row(out, "torch threads")), out  # OMP_NUM_THREADS=1


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(cli_generate, "load_model", refuse)
    monkeypatch.setattr(cli_loading, "_load_pretrained", refuse)  # where load_draft looks it up


@pytest.mark.parametrize("argv, words", [
    (["--device", "foo"], ["--device foo", "cpu, cuda or cuda:N"]),
    (["--device", "cuda:99"], ["--device cuda:99"]),
    (["--draft", "nonsense"], ["--draft nonsense", "prompt-lookup", "self", "checkpoint directory"]),
    (["--model", "no/such/dir"], ["--model no/such/dir", "no such directory", "local checkpoint directory"]),
    (["--repeats", "0"], ["--repeats"]),
])
def test_bad_arguments_give_one_line_before_any_model_loads(capsys, no_model_loads, argv, words):
    assert cli.main(["generate", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ssm-spec generate: error: "), captured.err
    for word in words:
        assert word in lines[0]
    assert captured.out == ""


def test_bad_draft_is_refused_before_the_target_loads(capsys, no_model_loads, tmp_path):
    (tmp_path / "draft").mkdir()
    assert cli.main(["generate", "--draft", str(tmp_path / "draft")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_an_unloadable_draft_checkpoint_fails_before_any_timed_run(capsys, monkeypatch, tmp_path):
    """A draft directory with a config but a broken weights file: a one-line error right after
    the target loads, before minutes of timed generation (no ``generate`` call at all)."""
    import shutil

    from ssm_spec.assets import demo_dir

    draft = tmp_path / "draft"
    draft.mkdir()
    shutil.copy(demo_dir() / "draft" / "config.json", draft / "config.json")
    (draft / "model.safetensors").write_bytes(b"")

    def no_timing(*args, **kwargs):
        raise AssertionError("a run was timed before the draft loaded")

    monkeypatch.setattr(cli_generate, "timed_generate", no_timing)
    assert cli.main(["generate", "--device", "cpu", "--max-new-tokens", "4", "--draft", str(draft)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ssm-spec generate: error: --draft") and "cannot load" in err[-1], err


def test_length_warning_comes_before_the_model_loads(capsys, monkeypatch):
    """Prompt + --max-new-tokens past the tiny model's max_position_embeddings (4096) warns on
    stderr before anything loads (here the load is stopped right after)."""
    def stop(*args, **kwargs):
        raise cli_generate.CLIError("stopped before the load")

    monkeypatch.setattr(cli_generate, "load_model", stop)
    assert cli.main(["generate", "--device", "cpu", "--max-new-tokens", "4090", "--prompt", "0123456789"]) == 2
    err = capsys.readouterr().err
    assert "warning: the prompt (10 tokens) plus --max-new-tokens (4090)" in err
    assert "max_position_embeddings (4096)" in err
    assert err.index("warning") < err.index("stopped before the load")


def test_length_warning_threshold():
    assert length_warning(10, 4086, 4096) is None
    assert "4097 tokens" in length_warning(11, 4086, 4096)
    assert length_warning(10, 10**6, None) is None


def test_busy_note_criterion():
    # CPU device: CPU time well below wall time means the process waited for a core
    assert "20%" in busy_note(0.2, 1.0, "cpu", 0.5, 4)
    assert busy_note(0.9, 1.0, "cpu", 0.5, 4) is None
    assert busy_note(3.5, 1.0, "cpu", 0.5, 4) is None  # several torch threads
    # CUDA: the host sleeps while the GPU runs, so only the load average counts
    assert busy_note(0.1, 1.0, "cuda", 0.5, 4) is None
    assert "load average (9.0) exceeds the 2 usable CPUs" in busy_note(0.1, 1.0, "cuda", 9.0, 2)
    assert busy_note(0.9, 1.0, "cpu", None, 2) is None


def test_saved_tiny_checkpoint_without_tokenizer(tmp_path):
    """A saved tiny Qwen3.5 (no tokenizer files): ByteTokenizer fallback with a note; --check."""
    from ssm_spec.hf import tiny_model

    tiny_model("qwen3_5", seed=3).save_pretrained(tmp_path)
    proc = _run("--model", tmp_path, "--max-new-tokens", 48, "--check", "--warmup", 0, "--device", "cpu",
                "--repeats", 1)
    _assert_ok_and_equal(proc)
    assert "ByteTokenizer" in proc.stderr
    assert "qwen3_5" in _row(proc.stdout, "model")
    assert RANDOM_WEIGHTS_NOTE not in proc.stdout  # a checkpoint's text is its own business


def test_not_a_gdn_model_exits_2(tmp_path, capsys, no_model_loads):
    """A Llama checkpoint directory is refused from its config, before any weight loads (in this
    process: the config check comes before anything process-wide is set)."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config refuses first
    assert cli.main(["generate", "--model", str(tmp_path)]) == 2
    assert "not a Qwen3-Next / Qwen3.5 model" in capsys.readouterr().err


def test_unknown_vocab_without_tokenizer_exits_2(tmp_path):
    """No tokenizer and a vocabulary that is not the byte tokenizer's: a clear error."""
    from ssm_spec.hf import tiny_config

    tiny_config("qwen3_next", vocab_size=1000).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config refuses first
    proc = _run("--model", tmp_path)
    assert proc.returncode == 2
    assert "no usable tokenizer" in proc.stderr and "1000" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--do-sample", "--check"], "needs greedy decoding"),
    (["--confidence-threshold", "2"], "--confidence-threshold"),
    (["--device", "meta"], "not supported"),
    (["--device", "cpu:1"], "not supported"),
    (["--draft", ""], "--draft: empty"),
    (["--temperature", "0.7"], "--temperature needs --do-sample"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    """Option conflicts are refused before anything loads."""
    assert cli.main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_selfcheck_still_parses():
    with pytest.raises(SystemExit) as exc:
        cli.main(["selfcheck", "--help"])
    assert exc.value.code == 0


def test_progress_streamer_counts_new_tokens_only():
    """The first put (the prompt) is skipped; later puts may carry several tokens (assisted
    generation) or one per row (plain decoding)."""
    streamer = ProgressStreamer(total=10, disable=False)  # a bar even where stderr is not a terminal
    streamer.put(torch.zeros(1, 7, dtype=torch.long))  # the prompt
    streamer.put(torch.zeros(1, dtype=torch.long))
    streamer.put(torch.zeros(1, 4, dtype=torch.long))
    streamer.end()
    assert streamer.tokens == 5
    assert streamer.bar.n == 5


def test_a_checkpoint_without_weights_is_refused_before_any_model_loads(capsys, no_model_loads, tmp_path):
    from ssm_spec.hf import tiny_config

    tiny_config("qwen3_next").save_pretrained(tmp_path)  # a config, no weights
    assert cli.main(["generate", "--draft", str(tmp_path)]) == 2
    assert "no weights" in capsys.readouterr().err


def test_busy_note_from_the_spread_of_repeats():
    from ssm_spec.hf.cli_generate import busy_note

    assert busy_note(1.0, 1.0, "cpu", 0.0, 2, spread=1.2) is None
    assert "differ up to 3.0x" in busy_note(1.0, 1.0, "cpu", 0.0, 2, spread=3.0)


def test_a_draft_with_another_vocabulary_is_refused_before_any_model_loads(capsys, no_model_loads, tmp_path):
    from ssm_spec.hf import tiny_config

    tiny_config("qwen3_next", vocab_size=300).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read
    assert cli.main(["generate", "--draft", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "vocabulary has 300 tokens" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("option", ["--model", "--draft"])
def test_demo_missing_from_the_build_is_one_line_before_any_model_loads(capsys, no_model_loads, monkeypatch,
                                                                         tmp_path, option):
    monkeypatch.setenv("SSM_SPEC_DEMO_DIR", str(tmp_path))  # a build without the demo pair
    assert cli.main(["generate", option, "demo"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ssm-spec generate: error: {option} demo: "), lines
    assert "train_demo_model.py" in lines[0]


def test_named_models_resolve_to_what_they_stand_for(monkeypatch, tmp_path):
    from types import SimpleNamespace

    args = SimpleNamespace(model="tiny-random", draft="prompt-lookup")
    cli_generate.resolve_names(args)
    assert args.model is None and args.draft == "prompt-lookup"  # the embedded random model
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("SSM_SPEC_DEMO_DIR", str(tmp_path))
    args = SimpleNamespace(model="demo", draft="demo")
    cli_generate.resolve_names(args)
    assert (args.model, args.draft) == (str(tmp_path / "target"), str(tmp_path / "draft"))


def test_default_model_with_an_unusable_demo_dir_is_an_error_not_the_random_model(capsys, no_model_loads,
                                                                                 monkeypatch, tmp_path):
    """SSM_SPEC_DEMO_DIR set to a directory without the pair: the default model is refused in one
    line (a newcomer's run found it silently running the random model instead)."""
    monkeypatch.setenv("SSM_SPEC_DEMO_DIR", str(tmp_path))
    assert cli.main(["generate"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ssm-spec generate: error: --model demo: "), lines


def test_demo_messages_name_the_member_and_where_it_was_looked_up(capsys, no_model_loads, monkeypatch, tmp_path):
    """``--draft demo`` missing points at ``DIR/draft`` (not ``--model DIR/target``), and a set
    ``SSM_SPEC_DEMO_DIR`` is named as the place looked in (not "this build")."""
    monkeypatch.setenv("SSM_SPEC_DEMO_DIR", str(tmp_path))
    assert cli.main(["generate", "--draft", "demo"]) == 2
    line = capsys.readouterr().err.strip()
    assert f"not in SSM_SPEC_DEMO_DIR={tmp_path}" in line and "DIR/draft" in line and "DIR/target" not in line
    monkeypatch.delenv("SSM_SPEC_DEMO_DIR")
    monkeypatch.setattr("ssm_spec.assets.demo_dir", lambda: tmp_path)  # a build without the pair
    assert cli.main(["generate", "--model", "demo"]) == 2
    assert "not in this build" in capsys.readouterr().err


@pytest.mark.parametrize("option, member", [("--model", "target"), ("--draft", "draft")])
def test_a_training_runs_output_dir_is_pointed_at_its_member(capsys, no_model_loads, tmp_path, option, member):
    (tmp_path / "demo.json").write_text("{}")  # scripts/train_demo_model.py --out DIR
    assert cli.main(["generate", option, str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / member) in lines[0] and f"SSM_SPEC_DEMO_DIR={tmp_path}" in lines[0]


@pytest.mark.hf_one_release  # the command's handling of a closed stdout
def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``ssm-spec generate | head``: a closed stdout is a quiet exit status 1, not a traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ssm_spec", "generate", "--model", "tiny-random", "--max-new-tokens",
                             "4", "--repeats", "1", "--warmup", "0", "--quiet", "--device", "cpu"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before anything is written
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 1 and "Traceback" not in err, err


def test_the_options_and_their_checks_import_neither_torch_nor_transformers(tmp_path):
    """``ssm_spec.hf.cli_args`` (the parser, ``--help``, the checks that need no model) runs on
    the standard library alone. The packages above it import torch in their ``__init__``, so
    they stand here as bare packages of the same folders."""
    code = ("import argparse, sys, types\n"
            "from pathlib import Path\n"
            "for name, folder in (('ssm_spec', 'ssm_spec'), ('ssm_spec.hf', 'ssm_spec/hf')):\n"
            "    package = types.ModuleType(name)\n"
            "    package.__path__ = [str(Path(folder).resolve())]\n"
            "    sys.modules[name] = package\n"
            "from ssm_spec.hf import cli_args\n"
            "parser = argparse.ArgumentParser(prog='ssm-spec generate')\n"
            "cli_args.add_arguments(parser)\n"
            "assert '--max-new-tokens' in parser.format_help()\n"
            "args = parser.parse_args(['--model', 'tiny-random', '--draft', 'demo', '--quiet'])\n"
            "cli_args.resolve_names(args)\n"
            "cli_args.check_values(args)\n"
            "for bad in (['--repeats', '0'], ['--do-sample', '--check']):\n"
            "    try:\n"
            "        cli_args.check_values(parser.parse_args(bad))\n"
            "    except cli_args.CLIError:\n"
            "        pass\n"
            "    else:\n"
            "        raise AssertionError(bad)\n"
            f"try:\n    cli_args.checkpoint_dir({str(tmp_path)!r}, '--model')\n"
            "except cli_args.CLIError as exc:\n    assert 'no config.json' in str(exc), exc\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
            "assert not loaded, loaded[:5]\n")
    env = {**os.environ, "SSM_SPEC_DEMO_DIR": ""}  # the packaged pair, as a user runs it
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.hf_one_release  # the command's thread count and progress bars
@pytest.mark.parametrize("threads, omp, want", [(None, None, 1), ("2", None, 2), (None, "2", 2)])
def test_threads_default_to_one_on_cpu_and_bars_stay_out_of_a_redirected_stderr(threads, omp, want):
    """No --threads on a CPU device: 1 intra-op thread (the tiny and demo models run as fast on one,
    and several times faster on a busy machine), unless OMP_NUM_THREADS chose; --threads N sets N.
    stderr is a pipe here: no progress bar frames in it, without --quiet too."""
    extra = [] if threads is None else ["--threads", threads]
    proc = _run("--max-new-tokens", 8, "--warmup", 0, "--repeats", 1, "--device", "cpu", *extra, omp_threads=omp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(rf"{want} intra-op, \d+ inter-op", _row(proc.stdout, "torch threads")), proc.stdout
    assert "\r" not in proc.stderr and "tok/s" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr[:500]


def test_threads_for_and_main_restores_the_thread_count(monkeypatch):
    from argparse import Namespace

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cli_loading.threads_for(Namespace(threads=None), torch.device("cpu")) == 1
    assert cli_loading.threads_for(Namespace(threads=None), torch.device("cuda")) is None
    assert cli_loading.threads_for(Namespace(threads=3), torch.device("cuda")) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cli_loading.threads_for(Namespace(threads=None), torch.device("cpu")) is None
    before = torch.get_num_threads()
    monkeypatch.setattr(cli_generate, "run", lambda args: torch.set_num_threads(before + 1) or 0)
    assert cli_generate.main(Namespace()) == 0
    assert torch.get_num_threads() == before


def test_threads_below_one_are_refused(capsys, no_model_loads):
    assert cli.main(["generate", "--threads", "0"]) == 2
    assert capsys.readouterr().err == "ssm-spec generate: error: --threads: expected >= 1, got 0\n"


def test_busy_note_says_what_to_do():
    """Each note ends with advice: --threads 1 where torch ran several threads on the CPU."""
    many = busy_note(0.2, 1.0, "cpu", 0.5, 4, threads=2)
    assert "torch ran 2 intra-op threads" in many and "pass --threads 1" in many
    assert "run again once the other jobs are done" in many
    for note in (busy_note(0.2, 1.0, "cpu", 0.5, 4, threads=1), busy_note(0.1, 1.0, "cuda", 9.0, 2, threads=8)):
        assert "--threads" not in note and note.endswith("run again once the other jobs are done (or stop them)")


def test_progress_bars_show_only_on_a_terminal(monkeypatch):
    """tqdm's disable=None: no bar where stderr is not a terminal (a log, a pipe); a bar on one."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        streamer = ProgressStreamer(total=4)
        streamer.put(torch.zeros(1, 2, dtype=torch.long))
        streamer.put(torch.zeros(1, 3, dtype=torch.long))
        streamer.end()
        assert streamer.tokens == 3 and (streamer.bar.n == 3) is shown
        assert bool(stream.getvalue()) is shown


# ---------------------------------------------------------------------------------------- --draft mtp
def _mtp_checkpoint(path, **kw):
    """A saved tiny Qwen3.5 with ``mtp.*`` tensors beside its own (tests/hf/test_mtp.py's; by
    default the token-copying head, which the tiny model accepts at times)."""
    from tests.hf.test_mtp import write_checkpoint

    write_checkpoint(path, "qwen3_5", seed=3, **{"copy_token": True, **kw})
    return path


def test_draft_mtp_drafts_with_the_checkpoints_head_and_equals_plain_greedy(tmp_path):
    """``--draft mtp``: ``generate(use_mtp=True, num_assistant_tokens=K)`` in the decode loop, the
    tokens plain greedy's, drafts offered at every one of the K positions and some accepted."""
    proc = _run("--model", _mtp_checkpoint(tmp_path), "--draft", "mtp", "--num-draft-tokens", 3, "--check",
                "--max-new-tokens", 32, "--warmup", 0, "--repeats", 1, "--device", "cpu", "--quiet")
    _assert_ok_and_equal(proc)
    assert _row(proc.stdout, "draft") == "the checkpoint's MTP head, 3 tokens", proc.stdout
    assert len(_row(proc.stdout, "acceptance by position").split()) == 3, proc.stdout
    assert float(_row(proc.stdout, "mean accepted length").split()[0]) > 1.0, proc.stdout


@pytest.mark.parametrize("case, words", [
    ("tiny-random", ["--draft mtp: the tiny random model has no MTP head"]),
    ("no count", ["cannot draft with an MTP head", "mtp_num_hidden_layers"]),
    ("no tensors", ["has no MTP head", "no mtp.* tensors in"]),
    ("damaged", ["cannot draft with an MTP head", "model.safetensors cannot be read as safetensors weights"]),
])
def test_draft_mtp_on_a_model_without_a_head_is_one_line_before_any_model_loads(capsys, no_model_loads, tmp_path,
                                                                               case, words):
    """No MTP head (or weights that cannot be read) is said from the config and the weights' names,
    before any model loads."""
    from ssm_spec.hf import tiny_model

    argv = ["--model", "tiny-random"]
    if case != "tiny-random":
        model = tiny_model("qwen3_5", seed=3)
        if case in ("no tensors", "damaged"):
            model.config.mtp_num_hidden_layers = 1
        model.save_pretrained(tmp_path)
        if case == "damaged":  # a download cut short
            data = (tmp_path / "model.safetensors").read_bytes()
            (tmp_path / "model.safetensors").write_bytes(data[:len(data) // 2])
        argv = ["--model", str(tmp_path)]
    assert cli.main(["generate", *argv, "--draft", "mtp", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    line = captured.err.strip().splitlines()[-1]
    assert line.startswith("ssm-spec generate: error: --draft mtp") and all(w in line for w in words), line
    assert captured.out == ""


def test_draft_mtp_with_tensors_that_do_not_fit_fails_before_any_timed_run(capsys, monkeypatch, tmp_path):
    """A head of two layers where the config declares one: refused right after the target loads."""
    _mtp_checkpoint(tmp_path, layers=2, count=1, copy_token=False)

    def no_timing(*args, **kwargs):
        raise AssertionError("a run was timed before the MTP head was read")

    monkeypatch.setattr(cli_generate, "timed_generate", no_timing)
    assert cli.main(["generate", "--model", str(tmp_path), "--draft", "mtp", "--device", "cpu"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("ssm-spec generate: error: --draft mtp: --model") and "mtp.layers.1" in line, line
