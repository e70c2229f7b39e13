"""``bench_hf_generate.py --model demo|PATH``: acceptance and speed of a trained pair on held-out code.

The demo pair (``scripts/train_demo_model.py``; :mod:`ssm_spec.assets`) was trained on the
standard library's source with a fixed held-out set of files (its ``demo.json``). Prompts come
from those files, read from the running Python's standard library: per file a continuation (its
first ``--prompt-bytes`` bytes) and an edit (those bytes, a marker comment and the first half
again with one identifier renamed, so the continuation can copy from the prompt). Per prompt,
each after a warm-up and as the median of ``--repeats`` calls (the CLI's
:func:`ssm_spec.hf.cli_generate.timed_generate`):

1. ``hf``: plain greedy ``generate`` on the unconverted target;
2. ``ours``: the target after ``apply_recoverssm``, no drafts;
3. ``ours+lookup``: prompt lookup (``prompt_lookup_num_tokens=k``);
4. ``ours+draft``: the trained draft as the assistant (``num_assistant_tokens=k``), converted too;
5. on CUDA unless ``--no-graphs``: (2)-(4) again with ``apply_recoverssm(cuda_graphs=True)``
   (``graphs``, ``graphs+lookup``, ``graphs+draft``). (2)-(5) run through transformers' own
   decoding loop (``decode_loop=False``);
6. unless ``--no-loop``: (2)-(4) through ssm-spec's decode loop (``loop``, ``loop+lookup``,
   ``loop+draft``; each round captured as one CUDA graph on CUDA unless ``--no-graphs``), and
   where the target's checkpoint holds an MTP head (``mtp.*``, ``scripts/train_demo_mtp.py``)
   ``loop+mtp k=K``: ``generate(use_mtp=True, num_assistant_tokens=K)`` for each ``--mtp-k``;
   the summary's ``loop+mtp`` is the fastest K's (``"k"`` names it), and the results' ``mtp``
   section has every K's tokens/s, its ratio to ``loop`` and its acceptance per draft position
   (or why the runs were skipped). ``--loop-only`` leaves (2)-(5) out.

Reported: tokens/s, acceptance (mean accepted length, per-position rates, from the
last call's :func:`~ssm_spec.hf.acceptance_stats`) and whether the tokens equal (1)'s; where they do not, the first new
token that differs and the unconverted target's logit gaps there (top-1 minus top-2, and (1)'s
token minus the run's), from one forward over the prompt and (1)'s tokens: a bf16 run parts
from transformers at a near-tie, a bug at a clear winner.
"""

from __future__ import annotations

import json
import re
import statistics
import sysconfig
from argparse import Namespace
from pathlib import Path

import torch
from _results import pyplot
from hf_agreement import first_diff, full_logits, gap_at
from timing import timing_spread

ROOT = Path(__file__).resolve().parents[1]


def recorded_path(path: Path) -> str:
    """A checkpoint's path as the results record it: relative to the repository when it lies
    inside (so committed JSON carries no machine's absolute paths), else as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _checkpoint(path: Path, option: str, given: str) -> Path:
    """``path`` when it holds a saved model (``config.json`` and safetensors weights); else a
    ``ValueError`` naming ``option`` and what was ``given``."""
    if not path.is_dir():
        raise ValueError(f"{option} {given}: no such directory ({path})")
    if not (path / "config.json").is_file() and (path / "demo.json").is_file():
        raise ValueError(f"{option} {given}: a training run's output directory, not a checkpoint: pass "
                         f"{path / ('draft' if option == '--draft' else 'target')}")
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ValueError(f"{option} {given}: {path} has no config.json and safetensors weights: not a saved model")
    return path


def demo_paths(model: str, draft: str | None) -> tuple[Path, Path, dict]:
    """``(target dir, draft dir, manifest)`` for ``--model demo`` (the packaged pair) or a
    training run's target directory (its draft and ``demo.json`` beside it unless ``draft``).

    Raises:
        ValueError: a pair that is not there (the message names the option): a missing demo
            pair, a directory without a saved model, no draft beside the target and no
            ``--draft``, or no ``demo.json`` with held-out files beside the target.
    """
    from ssm_spec.assets import demo_checkpoint

    try:
        target = demo_checkpoint("target") if model == "demo" else Path(model).expanduser()
        draft_dir = (demo_checkpoint("draft") if model == "demo" else target.parent / "draft") if draft is None \
            else Path(draft).expanduser()
    except FileNotFoundError as exc:
        raise ValueError(f"--model demo: {exc}") from None
    _checkpoint(target, "--model", model)
    if draft is None and not draft_dir.is_dir():
        raise ValueError(f"--model {model}: no draft beside it ({draft_dir}): pass --draft PATH")
    _checkpoint(draft_dir, "--draft" if draft is not None else "--model", draft if draft is not None else model)
    manifest_path = target.parent / "demo.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if not manifest.get("corpus", {}).get("held_out_files"):
        raise ValueError(f"--model {model}: no training manifest with held-out files beside it ({manifest_path}; "
                         "scripts/train_demo_model.py writes it): the prompts come from those files")
    return target, draft_dir, manifest


def held_out_prompts(manifest: dict, files: int, prompt_bytes: int, root: Path | None = None) -> list[dict]:
    """A continuation and an edit prompt per held-out file that this Python's standard library
    has and that is not empty (the first ``files`` of them). Raises ``ValueError`` when none is
    found."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    names = manifest.get("corpus", {}).get("held_out_files") or []
    prompts = []
    for rel in names:
        path = root / rel
        if not path.is_file():
            continue
        text = path.read_bytes()[:prompt_bytes].decode("utf-8", errors="ignore")
        if not text.strip():  # an empty __init__.py: nothing to prompt with
            continue
        idents = sorted(set(re.findall(r"\bdef ([A-Za-z_]\w{3,})", text)) or
                        set(re.findall(r"\b([A-Za-z_]\w{5,})\b", text)))
        half = text[:len(text) // 2]
        edit = half.replace(idents[0], idents[0] + "_v2") if idents else half
        prompts.append({"file": rel, "kind": "continuation", "text": text})
        prompts.append({"file": rel, "kind": "edit", "text": text + "\n\n# edited copy\n" + edit})
        if len(prompts) >= 2 * files:
            break
    if not prompts:
        raise ValueError(f"none of the manifest's {len(names)} held-out files is under {root}")
    return prompts


def mtp_missing(target_dir: Path) -> str | None:
    """Why the checkpoint at ``target_dir`` has no MTP head to draft with (no MTP layer count in
    its config, no ``mtp.*`` tensors), or ``None`` when it has one (names checked, not shapes:
    a head that does not load fails its run)."""
    from transformers import AutoConfig

    from ssm_spec.hf.mtp import config_layer_count, mtp_tensor_files

    try:
        config_layer_count(AutoConfig.from_pretrained(target_dir, local_files_only=True))
        where, files = mtp_tensor_files(target_dir)
    except ValueError as exc:
        return str(exc)
    return None if files else f"no mtp.* tensors in {recorded_path(Path(where))}"


def mtp_section(summary: dict, ks: list[int]) -> dict:
    """The ``mtp`` section of the results from the ``loop+mtp k=K`` rows of ``summary`` (which
    gains ``loop+mtp``: the fastest K's row with ``"k"``): per K the median tokens/s, its ratio
    to ``loop``'s, the mean accepted length and the acceptance per draft position."""
    loop = summary["loop"]["tokens_per_s_median"]
    by_k = {}
    for k in ks:
        s = summary[f"loop+mtp k={k}"]
        by_k[str(k)] = {"tokens_per_s_median": s["tokens_per_s_median"], "over_loop": s["tokens_per_s_median"] / loop,
                        "mean_accepted_length_mean": s.get("mean_accepted_length_mean"),
                        "position_rates_mean": s.get("position_rates_mean"), "tokens_equal_hf": s["tokens_equal_hf"]}
    best = max(ks, key=lambda k: by_k[str(k)]["tokens_per_s_median"])
    summary["loop+mtp"] = {**summary[f"loop+mtp k={best}"], "k": best}
    return {"k": list(ks), "best_k": best, "loop_mtp_over_loop": by_k[str(best)]["over_loop"], "by_k": by_k}


def _args(ns, draft: str) -> Namespace:
    """The CLI's generate arguments for :func:`timed_generate` and :func:`load_draft`."""
    return Namespace(max_new_tokens=ns.new_tokens, do_sample=False, temperature=None, warmup=ns.warmup_tokens,
                     repeats=ns.repeats, seed=ns.seed, quiet=True, num_draft_tokens=ns.num_draft_tokens,
                     confidence_threshold=0.0, draft=draft)


def divergence(run: list[int], hf: list[int], hf_logits: torch.Tensor, prompt_len: int) -> dict:
    """Whether ``run``'s new tokens equal ``hf``'s; if not, ``first_diff`` (the new token's index),
    both tokens and the unconverted target's gaps there (:func:`hf_agreement.gap_at` on
    ``hf_logits [prompt_len + len(hf), vocab]``, the logits of one forward over the prompt and
    ``hf``'s tokens: the prefix before ``first_diff`` is ``hf``'s by definition)."""
    d = first_diff(run, hf)
    if d is None:
        return {"tokens_equal_hf": True, "first_diff": None}
    entry = {"tokens_equal_hf": False, "first_diff": d}
    if d < min(len(run), len(hf)):  # else one run is a prefix of the other (an end of sequence)
        entry.update(token_hf=hf[d], token_run=run[d], **gap_at(hf_logits, prompt_len + d - 1, hf[d], run[d]))
    return entry


def summarize_runs(rows: list[dict]) -> dict:
    """Per run, over the prompts in ``rows`` (each ``{"runs": {name: entry}}`` as
    :func:`run_demo` records them): the median tokens/s, its ratio to ``hf``'s, the mean
    acceptance, how many prompts equal ``hf`` and the largest top1-top2 gap of the unconverted
    target where a run first differs (``None`` when none differs by a token: equal, or shorter
    or longer only)."""
    names = list(rows[0]["runs"])
    summary = {}
    for name in names:
        vals = [r["runs"][name] for r in rows]
        s = {"tokens_per_s_median": statistics.median(v["tokens_per_s"] for v in vals)}
        if "mean_accepted_length" in vals[0]:
            s["mean_accepted_length_mean"] = statistics.fmean(v["mean_accepted_length"] for v in vals)
            width = max(len(v["position_rates"]) for v in vals)
            s["position_rates_mean"] = [statistics.fmean(v["position_rates"][j] if j < len(v["position_rates"])
                                                         else 0.0 for v in vals) for j in range(width)]
        if name != "hf":
            s["tokens_equal_hf"] = all(v["tokens_equal_hf"] for v in vals)
            s["prompts_equal_hf"] = sum(v["tokens_equal_hf"] for v in vals)
            gaps = [v["top1_minus_top2"] for v in vals if "top1_minus_top2" in v]  # a length-only difference has none
            s["largest_top1_minus_top2_at_first_diff"] = max(gaps) if gaps else None
            s["speedup_over_hf"] = s["tokens_per_s_median"] / summary["hf"]["tokens_per_s_median"]
        summary[name] = s
    return summary


def run_demo(ns, progress=None) -> dict:
    """Run every prompt through the runs above; returns the results dict (per prompt and summed).
    Each run records its timed calls' seconds and their spread (a warning names a run whose calls
    differ by more than ``timing.TIMING_SPREAD_LIMIT``), and prints its tokens/s as it is measured.
    ``progress`` (a :class:`_results.PartialResults`, or None) is given the pair and the per-prompt
    rows after each run, so a run cut by a time limit keeps what it measured."""
    progress = progress or (lambda **parts: None)
    from ssm_spec.hf import ByteTokenizer, apply_recoverssm
    from ssm_spec.hf.cli_generate import _load_pretrained, load_draft, timed_generate

    device = torch.device(ns.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[ns.dtype]
    target_dir, draft_dir, manifest = demo_paths(ns.model, ns.draft)
    prompts = held_out_prompts(manifest, ns.prompt_files, ns.prompt_bytes)
    tok = ByteTokenizer()
    target = _load_pretrained(target_dir, "--model", dtype, device)
    args = _args(ns, str(draft_dir))
    ids = [torch.tensor([tok.encode(p["text"])], device=device) for p in prompts]
    plain = [timed_generate(target, x, args, desc="hf") for x in ids]
    plain_logits = [full_logits(target, torch.cat([x, r.new_tokens.to(x.device).reshape(1, -1)], 1))
                    for x, r in zip(ids, plain)]
    apply_recoverssm(target, decode_loop=False)
    draft, _ = load_draft(args, target, device, dtype)
    # (run prefix, decode loop, CUDA graphs): transformers' loop eager and graphed, then ssm-spec's
    # decode loop (graphed on CUDA with --graphs)
    cuda = device.type == "cuda"
    modes = [] if getattr(ns, "loop_only", False) else (
        [("", False, False)] + ([("graphs", False, True)] if ns.graphs and cuda else []))
    modes += [("loop", True, bool(ns.graphs and cuda))] if ns.loop else []
    no_mtp = mtp_missing(target_dir) if ns.loop else "--no-loop (the MTP head drafts in the decode loop)"
    mtp_ks = [] if no_mtp else list(getattr(ns, "mtp_k", None) or [])
    if no_mtp:
        print(f"loop+mtp: skipped: {no_mtp}", flush=True)
    rows = []
    for i, (p, x) in enumerate(zip(prompts, ids)):
        rows.append({"file": p["file"], "kind": p["kind"], "prompt_tokens": x.shape[1],
                     "runs": {"hf": {"tokens_per_s": plain[i].tokens_per_s, "times_s": list(plain[i].times),
                                     "times_spread": timing_spread(f"hf, prompt {i}", plain[i].times)}}})
        print(f"prompt {i}, {'hf':<16} {plain[i].tokens_per_s:9.1f} tok/s", flush=True)
    pair = {"model": recorded_path(target_dir), "draft": recorded_path(draft_dir), "dtype": ns.dtype,
            "device": str(device), "new_tokens": ns.new_tokens, "num_draft_tokens": ns.num_draft_tokens}
    progress(**pair, prompts=rows)
    for prefix, loop, graphs in modes:
        apply_recoverssm(target, decode_loop=loop, cuda_graphs=graphs,
                         compile={"on": True, "off": False}.get(getattr(ns, "compile", "auto"), "auto"))
        for i, x in enumerate(ids):
            runs = [("ours", None), ("ours+lookup", dict(prompt_lookup_num_tokens=ns.num_draft_tokens)),
                    ("ours+draft", dict(assistant_model=draft))]
            if loop:
                runs += [(f"ours+mtp k={k}", dict(use_mtp=True, num_assistant_tokens=k)) for k in mtp_ks]
            for name, spec in runs:
                key = name.replace("ours", prefix) if prefix else name
                r = timed_generate(target, x, args, desc=key, speculative=spec)
                entry = {"tokens_per_s": r.tokens_per_s, "times_s": list(r.times),
                         "times_spread": timing_spread(f"{key}, prompt {i}", r.times),
                         **divergence(r.new_tokens.reshape(-1).tolist(), plain[i].new_tokens.reshape(-1).tolist(),
                                      plain_logits[i], x.shape[1])}
                if r.stats is not None:
                    entry.update(mean_accepted_length=r.stats.mean_accepted_length,
                                 acceptance_rate=r.stats.acceptance_rate,
                                 position_rates=list(r.stats.position_rates))
                rows[i]["runs"][key] = entry
                per_round = f" ({r.stats.mean_accepted_length:.2f} tokens/round)" if r.stats is not None else ""
                print(f"prompt {i}, {key:<16} {r.tokens_per_s:9.1f} tok/s{per_round}", flush=True)
                progress(prompts=rows)
    summary = summarize_runs(rows)
    mtp = mtp_section(summary, mtp_ks) if mtp_ks else {"skipped": no_mtp or "--mtp-k names no k"}
    return {**pair, "repeats": ns.repeats,
            "held_out_bits_per_byte": manifest.get("held_out_bits_per_byte"), "prompts": rows, "summary": summary,
            "mtp": mtp}


def print_demo(res: dict) -> None:
    print(f"demo pair: {res['model']} + {res['draft']}, {res['dtype']} on {res['device']}, "
          f"{res['new_tokens']} new tokens, k={res['num_draft_tokens']}, {len(res['prompts'])} prompts")
    n = len(res["prompts"])
    print(f"{'run':<16} | {'tok/s (median)':>14} | {'vs hf':>6} | {'accepted/round':>14} | equal | per position")
    for name, s in res["summary"].items():
        rates = " ".join(f"{r:.2f}" for r in s.get("position_rates_mean", []))
        equal = "-" if name == "hf" else f"{s['prompts_equal_hf']}/{n}"
        print(f"{name:<16} | {s['tokens_per_s_median']:>14.1f} | {s.get('speedup_over_hf', 1.0):>5.2f}x | "
              f"{s.get('mean_accepted_length_mean', float('nan')):>14.2f} | "
              f"{equal:>5} | {rates}")
    mtp = res.get("mtp") or {}
    if "best_k" in mtp:
        print(f"loop+mtp: best k={mtp['best_k']}, {mtp['loop_mtp_over_loop']:.2f}x loop; by k: "
              + ", ".join(f"{k}: {v['tokens_per_s_median']:.1f} tok/s ({v['over_loop']:.2f}x)"
                          for k, v in mtp["by_k"].items()))
    elif mtp.get("skipped"):
        print(f"loop+mtp: skipped ({mtp['skipped']})")
    for i, p in enumerate(res["prompts"]):
        for name, r in p["runs"].items():
            if name != "hf" and not r["tokens_equal_hf"] and "top1_minus_top2" in r:
                print(f"  prompt {i} ({p['file']} {p['kind']}), {name}: first difference at new token "
                      f"{r['first_diff']} ({r['token_hf']} vs {r['token_run']}); unconverted target there: "
                      f"top1-top2 {r['top1_minus_top2']:.4g}, logit(hf)-logit(run) {r['logit_a_minus_b']:.4g}")


def save_demo_plot(res: dict, path) -> bool:
    """Tokens/s per run (median over prompts) and the per-position acceptance of the drafted runs."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = list(res["summary"])
    a.bar(names, [res["summary"][n]["tokens_per_s_median"] for n in names])
    a.set_ylabel("tokens/s (median over prompts)")
    a.tick_params(axis="x", rotation=30)
    for n in names:
        rates = res["summary"][n].get("position_rates_mean")
        if rates:
            b.plot(range(1, len(rates) + 1), rates, marker="o", label=n)
    b.set_xlabel("draft position")
    b.set_ylabel("acceptance rate")
    b.legend()
    fig.suptitle(f"demo pair, {res['dtype']}, {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
