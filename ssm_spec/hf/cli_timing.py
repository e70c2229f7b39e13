"""``ssm-spec generate``'s timed ``generate`` runs: an untimed warm-up, then ``--repeats``
timed calls with a progress bar each (:func:`timed_generate`, its :class:`RunResult`)."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

__all__ = ["ProgressStreamer", "RunResult", "timed_generate"]


class ProgressStreamer(BaseStreamer):
    """A ``generate`` streamer that advances a tqdm bar by the tokens each ``put`` brings.

    ``generate`` calls ``put`` first with the prompt (skipped), then with each step's new tokens
    (assisted generation and prompt lookup put several at once), and ``end`` when done.

    Args:
        total: the bar's length (``max_new_tokens``).
        desc: the bar's label.
        disable: ``True``: no bar at all (``--quiet``); ``None`` (the default): no bar where
            stderr is not a terminal (a log or a pipe would collect every redrawn frame).

    Attributes:
        tokens: new tokens seen so far.
    """

    def __init__(self, total: int, desc: str = "generating", disable: bool | None = None):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="tok", disable=disable, leave=False, file=sys.stderr)
        self.tokens = 0
        self._prompt_seen = False

    def put(self, value) -> None:
        """Count ``value`` (token ids of batch 1); the first call (the prompt) is skipped."""
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        n = int(value.numel()) if isinstance(value, torch.Tensor) else len(value)
        self.tokens += n
        self.bar.update(n)

    def end(self) -> None:
        """Close the bar."""
        self.bar.close()


@dataclass
class RunResult:
    """The timed ``generate`` calls of one run: the last call's new token ids, the median
    seconds, the (speculative) stats of the last call, and every call's seconds, with the
    process CPU time and wall time over all of them (for :func:`~ssm_spec.hf.cli_report.busy_note`)."""

    new_tokens: torch.Tensor
    seconds: float
    stats: object | None = None
    times: tuple[float, ...] = ()
    cpu_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens.numel() / self.seconds if self.seconds > 0 else float("inf")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _gen_kwargs(args, model) -> dict:
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    if args.do_sample and args.temperature is not None:
        kw["temperature"] = args.temperature
    if model.generation_config.pad_token_id is None and model.generation_config.eos_token_id is not None:
        eos = model.generation_config.eos_token_id
        kw["pad_token_id"] = eos[0] if isinstance(eos, (list, tuple)) else eos
    return kw


def timed_generate(model, input_ids, args, *, desc: str, speculative: dict | None = None) -> RunResult:
    """Run ``model.generate`` on ``input_ids [1, L]`` once untimed (``--warmup`` tokens), then
    ``--repeats`` times timed, each with a progress bar. Returns a :class:`RunResult` (the
    median time, the last call's new tokens).

    ``speculative`` holds the draft arguments (``prompt_lookup_num_tokens`` or
    ``assistant_model``); when given, ``model`` must be converted, and the last call's
    acceptance (:func:`~ssm_spec.hf.acceptance_stats`) comes back in the result.
    """
    from .config import acceptance_stats, is_converted, recoverssm_config

    kw = _gen_kwargs(args, model)
    kw.update(speculative or {})
    mask = torch.ones_like(input_ids)
    graphed = is_converted(model) and recoverssm_config(model).cuda_graphs
    with torch.inference_mode():
        if args.warmup:
            if args.do_sample:
                torch.manual_seed(args.seed)
            # graphed: the whole length, so the decode loop the timed calls reuse (its buffers, its
            # captured rounds) is the one the warm-up builds
            warm = {**kw, "max_new_tokens": args.max_new_tokens if graphed else args.warmup}
            model.generate(input_ids, attention_mask=mask, **warm)
        times, cpu_s = [], 0.0
        for i in range(args.repeats):
            label = desc if args.repeats == 1 else f"{desc} {i + 1}/{args.repeats}"
            streamer = ProgressStreamer(args.max_new_tokens, desc=label, disable=True if args.quiet else None)
            if args.do_sample:
                torch.manual_seed(args.seed)
            _sync(input_ids.device)
            cpu0, start = time.process_time(), time.perf_counter()
            try:
                out = model.generate(input_ids, attention_mask=mask, streamer=streamer, **kw)
                _sync(input_ids.device)
            finally:
                streamer.bar.close()
            times.append(time.perf_counter() - start)
            cpu_s += time.process_time() - cpu0
    stats = None
    if speculative is not None:
        stats = acceptance_stats(model)  # the last call's: the decode loop's, or its cache's
    return RunResult(out[0, input_ids.shape[1]:].cpu(), statistics.median(times), stats, tuple(times), cpu_s,
                     sum(times))
