"""``ssm-spec generate``'s report: the text, the table of the three timed runs (tokens/s,
speed-ups, threads, acceptance statistics, ``--check``'s verdict) and the notes after it
(:func:`print_report`), with the busy-machine criterion (:func:`busy_note`)."""

from __future__ import annotations

import os

import torch

__all__ = ["BUSY_CPU_FRACTION", "BUSY_SPREAD", "POSITIONS_SHOWN", "RANDOM_WEIGHTS_NOTE", "busy_note", "format_table",
           "print_report", "printable", "usable_cpus"]

POSITIONS_SHOWN = 8  # per-position acceptance rates printed
#: The line printed before the default model's text.
RANDOM_WEIGHTS_NOTE = ("note: --model tiny-random has random weights, so its text is random bytes (not language); "
                       "the default, --model demo, is a trained model, and --model PATH runs a checkpoint")
#: ``busy_note``'s thresholds: process CPU time over wall time of the timed calls below this, and
#: the slowest over the fastest of one configuration's repeats above ``BUSY_SPREAD``.
BUSY_SPREAD = 1.5
BUSY_CPU_FRACTION = 0.5


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_note(cpu_s: float, wall_s: float, device_type: str, load_1min: float | None, cpus: int,
              spread: float | None = None, threads: int | None = None) -> str | None:
    """A note when the machine looked busy during the timed calls, or None.

    Two signs, each sound on its own:

    * on a CPU device (``device_type == "cpu"``), process CPU time (all threads) below
      ``BUSY_CPU_FRACTION`` (half) of the wall time. A ``generate`` call there is computation
      in this process, with no device or disk to wait for: on a free machine at least one of
      its threads is running at every moment, so CPU time is at least about the wall time (more
      with torch's intra-op threads). Less than half means the process was runnable but not
      running for over half the time: other processes had the cores. On CUDA the host sleeps in
      synchronisations while the GPU works, so the ratio says nothing there and is not used;
    * on any device, a 1-minute load average (runnable processes, this one included) above the
      number of CPUs this process may use: more work than cores;
    * ``spread``: the largest ratio of the slowest to the fastest of one configuration's timed
      repeats, above ``BUSY_SPREAD``: identical calls whose times differ that much were
      disturbed (intra-op threads spin while they wait, so CPU time alone can miss contention).

    The timings are then inflated by the wait and say little about the code. The note says
    what to do: on a CPU device with ``threads`` (torch's intra-op threads) above 1, pass
    ``--threads 1`` (threads that wait for a taken core wait for one another: measured several
    times slower on a busy 2-core machine); in any case, run again once other jobs are done.
    """
    why = []
    if device_type == "cpu" and wall_s > 0 and cpu_s < BUSY_CPU_FRACTION * wall_s:
        why.append(f"this process ran on a CPU for only {cpu_s / wall_s:.0%} of the timed wall time "
                   f"({cpu_s:.2f} s of {wall_s:.2f} s)")
    if load_1min is not None and load_1min > cpus:
        why.append(f"the 1-minute load average ({load_1min:.1f}) exceeds the {cpus} usable CPUs")
    if spread is not None and spread > BUSY_SPREAD:
        why.append(f"repeats of one configuration differ up to {spread:.1f}x")
    if not why:
        return None
    advice = "run again once the other jobs are done (or stop them)"
    if device_type == "cpu" and threads is not None and threads > 1:
        advice = (f"torch ran {threads} intra-op threads, which wait for one another while another process holds a "
                  f"core: pass --threads 1, or {advice}")
    return ("note: the machine looks busy (" + "; ".join(why) + "): other processes competed for the CPUs, "
            f"so the times above are inflated and their ratios uncertain; {advice}")


def _load_1min() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _timing_row(name: str, r) -> tuple[str, str]:
    calls = "1 call" if len(r.times) == 1 else f"median of {len(r.times)} calls"
    return (f"tokens/s, {name}", f"{r.tokens_per_s:.1f} ({r.new_tokens.numel()} tokens in {r.seconds:.3f} s, "
                                  f"{calls})")


def printable(text: str) -> str:
    """``text`` with control characters (other than newline and tab) escaped, for a terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def format_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns: ``name  value`` per row."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _stats_rows(stats) -> list[tuple[str, str]]:
    if stats is None or not stats.rounds:
        return [("rounds", "0 (no speculative round ran)")]
    empty = getattr(stats, "empty_rounds", None)  # rounds in which prompt lookup found no draft
    rows = [("rounds", f"{stats.rounds}" + (f" ({empty} in which the draft source proposed nothing)" if empty else "")),
            ("mean accepted length", f"{stats.mean_accepted_length:.2f} tokens per round")]
    if not stats.drafted:
        return rows + [("acceptance rate", "- (no drafts)")]
    rates = stats.position_rates[:POSITIONS_SHOWN]
    more = " ..." if len(stats.position_rates) > POSITIONS_SHOWN else ""
    return rows + [
        ("acceptance rate", f"{stats.acceptance_rate:.1%} ({stats.accepted} of {stats.drafted} drafts)"),
        ("acceptance by position", " ".join(f"{r:.2f}" for r in rates) + more),
    ]


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def print_report(args, tokenizer, device: torch.device, dtype: torch.dtype, graphs: bool, model_desc: str,
                 draft_desc: str, plain, converted, spec) -> int:
    """Print to stdout the drafted run's text (after :data:`RANDOM_WEIGHTS_NOTE` for the tiny
    model), the table, and the busy-machine and ``--check`` notes.

    Args:
        args: the parsed options.
        tokenizer: decodes ``spec``'s new tokens (``cli_loading.load_tokenizer``'s).
        device, dtype: where and in what the runs ran.
        graphs: whether the converted runs asked for CUDA graphs.
        model_desc, draft_desc: the table's ``model`` and ``draft`` rows.
        plain, converted, spec: the :class:`~ssm_spec.hf.cli_timing.RunResult` of plain
            transformers, converted without drafts, and converted with drafts.

    Returns the exit status: 0, or 1 when ``--check`` finds tokens that differ from plain greedy.
    """
    if args.model is None:
        print(RANDOM_WEIGHTS_NOTE)
    print(printable(tokenizer.decode(spec.new_tokens)))
    print()
    runs = (plain, converted, spec)
    rows = [
        ("model", model_desc),
        ("draft", draft_desc),
        ("device / dtype", f"{device} / {args.dtype}, {'sampling' if args.do_sample else 'greedy'}"
                           + ((", CUDA graphs" if device.type == "cuda" else ", graphed forward run eagerly (no CUDA)")
                              if graphs else "")),
        ("torch threads", f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op "
                          f"({usable_cpus()} usable CPUs)"),
        ("new tokens", str(spec.new_tokens.numel())),
        _timing_row("plain transformers", plain),
        _timing_row("converted, no drafts", converted),
        _timing_row("converted, with drafts", spec),
        ("speed-up over transformers", f"{spec.tokens_per_s / plain.tokens_per_s:.2f}x (tokens/s of converted, "
                                       "with drafts / tokens/s of plain transformers)"),
        ("speed-up from drafts", f"{spec.tokens_per_s / converted.tokens_per_s:.2f}x (tokens/s of converted, with "
                                 "drafts / tokens/s of converted, no drafts)"),
        *_stats_rows(spec.stats),
    ]
    status = 0
    if args.check:
        equal = torch.equal(spec.new_tokens, plain.new_tokens)
        rows.append(("tokens equal plain greedy", "yes" if equal else f"no (first difference at new token "
                                                                      f"{_first_diff(spec.new_tokens, plain.new_tokens)})"))
        if not equal:
            status = 1
    print(format_table(rows))
    spread = max((max(r.times) / min(r.times) for r in runs if len(r.times) > 1 and min(r.times) > 0), default=None)
    busy = busy_note(sum(r.cpu_s for r in runs), sum(r.wall_s for r in runs), device.type, _load_1min(),
                     usable_cpus(), spread, torch.get_num_threads())
    if busy:
        print(busy)
    if status and dtype != torch.float32:
        print(f"note: in {args.dtype} the converted layers and transformers' own layers round differently, so "
              "greedy tokens can diverge; the tokens are equal in float32")
    return status
