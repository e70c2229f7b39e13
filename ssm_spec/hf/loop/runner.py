"""The decode loop itself: a round on the device, captured as one CUDA graph per bucket and
drafter, replayed several times between host reads (docs/design.md section 7.7).

A call begins with the prompt: the target's prefill of every row from the zero state, the first
new token, the drafter's start (an assistant's prefill, the MTP head's pass over the prompt);
captured too, one graph per prompt width (:func:`prompt_width`).

A round: the drafter's proposals (none for plain decoding), the target's verify forward of
``k + 1`` tokens per row from its kept state, the scores and acceptance, the tokens appended to
each row (stopping at end-of-sequence tokens and budgets), the target's RecoverSSM commit of the
kept window tokens, the drafter's own update (an assistant's commit; the MTP head's pass over
the newly kept positions with the verify's hidden states), the acceptance counters. Nothing in
it reads a value back on the host, so a round is one CUDA graph; the host replays a batch of
rounds and then reads one flag (are all rows finished?) and the rows' counts. Off CUDA, or
without ``cuda_graphs``, the same round runs eagerly.
"""

from __future__ import annotations

import math
import warnings

import torch

from ...capture import CaptureError, GraphCapture
from ..cache import AcceptanceStats
from .accept import accept_greedy, accept_matching, accept_rejection, draw
from .forward import LoopModel, compiled
from .rows import Rows

__all__ = ["DecodeLoop", "MAX_ROUNDS_PER_READ", "PLAIN_ROUNDS_PER_GRAPH", "PREFILL_WIDTH_ROUND", "prompt_width"]

#: The most rounds the host queues before it reads whether every row has finished (without a
#: streamer: with one it reads after every replay).
MAX_ROUNDS_PER_READ = 64
#: Plain decoding (no drafter) captures this many one-token rounds in one graph.
PLAIN_ROUNDS_PER_GRAPH = 4
#: With CUDA graphs a prompt's width is rounded up to a multiple of this many columns (more left
#: padding), so prompts of similar lengths share one captured prefill (fla's chunk length).
PREFILL_WIDTH_ROUND = 64


def prompt_width(prompt_columns: int, graphs: bool) -> int:
    """The loop's prompt width for a prompt of ``prompt_columns``: rounded up to
    :data:`PREFILL_WIDTH_ROUND` when prefills are captured (``graphs``), else unchanged."""
    if not graphs:
        return int(prompt_columns)
    return -(-int(prompt_columns) // PREFILL_WIDTH_ROUND) * PREFILL_WIDTH_ROUND


class DecodeLoop:
    """The loop for one batch bucket, target, drafter and scoring; kept on the model and reused
    by later calls with the same key (its graphs stay valid: they read fixed buffers).

    Args:
        model: the converted target.
        batch_size: the bucket's rows.
        capacity: token columns of the buffers.
        drafter: a drafter (:class:`~ssm_spec.hf.loop.lookup.PromptLookup`,
            :class:`~ssm_spec.hf.loop.assistant.AssistantDrafter`,
            :class:`~ssm_spec.hf.loop.mtp.MTPDrafter`, ...) or ``None``. One with
            ``needs_hidden = True`` gets the target's hidden states after its final norm:
            ``start(rows, width, hidden=[B, width, H])`` after the prefill and
            ``accept(a, active, hidden=[B, k + 1, H])`` after each verify.
        scoring: the :class:`~ssm_spec.hf.loop.accept.Scoring` of the call.
        sampling: sample (``do_sample=True``) instead of greedy.
        eos: ``[E]`` int64 end-of-sequence ids.
        pad_token_id: filler after a row's end.
        graphs: capture rounds as CUDA graphs (a CUDA model only).
        state_dtype / mode: the target's recurrent states.
        compile: the target's verify forwards, the rows' append and the acceptance counters
            through ``torch.compile(fullgraph=True, dynamic=False)``
            (:func:`~ssm_spec.hf.loop.forward.compiled`; the drafter's own parts by its own
            setting). Scores and acceptance stay eager: an argmax over tied scores must pick
            what plain greedy picks.
    """

    def __init__(self, model, batch_size: int, capacity: int, drafter, scoring, sampling: bool, eos: torch.Tensor,
                 pad_token_id: int, *, graphs: bool, state_dtype=torch.float32, mode: str = "exact",
                 compile: bool = False):
        self.drafter, self.scoring, self.sampling, self.eos = drafter, scoring, sampling, eos
        self.k = 0 if drafter is None else drafter.k
        #: the drafter reads the target's hidden states (after its final norm): the prompt's in
        #: ``start(..., hidden=)``, each verify window's in ``accept(..., hidden=)`` (the MTP head)
        self.needs_hidden = bool(getattr(drafter, "needs_hidden", False))
        self.target = LoopModel(model, batch_size, capacity, self.k + 1, state_dtype=state_dtype, mode=mode,
                                compile=compile)
        device = self.target.cache.device
        self.rows = Rows(batch_size, capacity, device, pad_token_id, compile=compile)
        self.graphs = graphs and device.type == "cuda"
        self.per_graph = 1 if drafter is not None else PLAIN_ROUNDS_PER_GRAPH
        self.graph = None
        self.failed: str | None = None  # why capture was given up (the rounds then run eagerly)
        #: captured prompt parts (:meth:`_begin`) by prompt width
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_failed: str | None = None  # why prefill capture was given up (prefills then run eagerly)
        self._capture = GraphCapture(device, "decode loop") if self.graphs else None
        k = max(self.k, 1)
        i64 = dict(dtype=torch.int64, device=device)
        self.counters = {"rounds": torch.zeros((), **i64), "empty_rounds": torch.zeros((), **i64),
                         "drafted": torch.zeros((), **i64), "accepted": torch.zeros((), **i64),
                         "offered": torch.zeros(k, **i64), "per_position": torch.zeros(k, **i64)}
        self.replays = 0
        self.eager_rounds = 0
        #: any of its forwards or bookkeeping compiled (the drafter's by its own setting)
        self.compiles = bool(compile) or bool(getattr(drafter, "compiles", False))
        # the acceptance counters: integer operations only, fused when the loop compiles
        self._count_fn = compiled(DecodeLoop._add_counts) if compile else DecodeLoop._add_counts

    # ------------------------------------------------------------------ one round
    def _round(self) -> None:
        rows, target = self.rows, self.target
        active = ~rows.finished
        if self.drafter is None:
            columns = rows.window_columns(1)
            logits, md = target.verify(rows.window_tokens(columns), columns, rows, active)
            n = rows.append(self._choose(self.scoring(logits, rows)), torch.ones_like(rows.produced), self.eos)
            target.commit(md, n)
            return
        drafts, num_drafts, probs = self.drafter.propose(rows)
        tokens = torch.cat([rows.last_token()[:, None], drafts], dim=1)
        columns = rows.window_columns(self.k + 1)
        if self.needs_hidden:
            logits, md, hidden = target.verify(tokens, columns, rows, active, hidden=True)
        else:
            logits, md = target.verify(tokens, columns, rows, active)
        scores = self.scoring(logits, rows)
        if not self.sampling:
            emitted, a = accept_greedy(drafts, num_drafts, scores)
        elif probs is None:
            emitted, a = accept_matching(drafts, num_drafts, scores)
        else:
            emitted, a = accept_rejection(drafts, num_drafts, scores, probs)
        n = rows.append(emitted, a + 1, self.eos)
        target.commit(md, n)
        if self.needs_hidden:
            self.drafter.accept(a, active, hidden=hidden)
        elif hasattr(self.drafter, "accept"):
            self.drafter.accept(a, active)
        self._count(active, num_drafts, a, n)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The next token at every position of ``scores [B, W, V]``: drawn, or the argmax."""
        return draw(torch.softmax(scores, -1)) if self.sampling else scores.argmax(-1)

    def _count(self, active, num_drafts, a, n) -> None:
        self._count_fn(self, active, num_drafts, a, n)

    def _add_counts(self, active, num_drafts, a, n) -> None:
        """Add a round to the counters (``n [B]``: the tokens each row kept, already appended).
        Only drafts inside each row's token budget count, the budget as it was before the round:
        in a row's last round the fixed-width window may hold more."""
        c = self.counters
        num_drafts = torch.minimum(num_drafts, (self.rows.max_new - self.rows.produced + n - 1).clamp_min(0))
        a = torch.minimum(a, num_drafts)
        act = active.to(torch.int64)
        pos = torch.arange(self.k, device=a.device)[None, :]
        c["rounds"] += act.sum()
        c["empty_rounds"] += (act * (num_drafts == 0)).sum()
        c["drafted"] += (act * num_drafts).sum()
        c["accepted"] += (act * a).sum()
        c["offered"] += (act[:, None] * (pos < num_drafts[:, None])).sum(0)
        c["per_position"] += (act[:, None] * (pos < a[:, None])).sum(0)

    def _rounds(self) -> None:
        for _ in range(self.per_graph):
            self._round()

    # ------------------------------------------------------------------ capture
    def _ensure_graph(self) -> None:
        """Capture the round(s) once, on padding rows only, before a sequence's prefill: every
        buffer the graph reads is then reloaded in place, and nothing it writes while capturing
        is kept."""
        if not self.graphs or self.graph is not None:
            return
        self.rows.finished.fill_(True)
        try:
            # once unchecked first: what runs only on a first call (buffers made lazily, autotuners
            # timing their candidates, library plans) may wait for the device; the checked warm-up
            # and the capture then see only what every round does
            self._rounds()
            torch.cuda.synchronize(self.rows.device)
            self._capture.warmup(self._rounds, what="a round")
            self.graph, _ = self._capture.capture(self._rounds, what="a round")
        except CaptureError as exc:  # loud, never silently wrong: the same rounds then run eagerly
            self.graphs, self.failed = False, str(exc)
            warnings.warn(f"decode loop: a round cannot be captured as a CUDA graph; running it eagerly. {exc}",
                          RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ the prompt
    def _begin(self, width: int) -> None:
        """The prompt's part of a call, for every row: the target's prefill of the first ``width``
        columns, the first new token, the drafter's start. No host reads: one graph per width."""
        rows = self.rows
        if self.needs_hidden:
            logits, hidden = self.target.prefill(rows, width, hidden=True)
        else:
            logits = self.target.prefill(rows, width)
        rows.append(self._choose(self.scoring(logits, rows)), torch.ones_like(rows.produced), self.eos)
        if self.needs_hidden:
            self.drafter.start(rows, width - 1, hidden=hidden)
        elif self.drafter is not None and hasattr(self.drafter, "start"):
            self.drafter.start(rows, width - 1)

    def prompt_width(self, prompt_columns: int) -> int:
        """The width this loop runs a prompt of ``prompt_columns`` at (:func:`prompt_width`)."""
        return prompt_width(prompt_columns, self.graphs and self.prefill_failed is None)

    def _prefill_graph(self, width: int):
        """The captured :meth:`_begin` of ``width`` (captured now, on padding rows, if it is new);
        ``None`` without graphs or after a prefill capture failed (then it runs eagerly)."""
        if not self.graphs or self.prefill_failed is not None:
            return None
        graph = self.prefill_graphs.get(width)
        if graph is not None:
            return graph
        self.rows.finished.fill_(True)
        try:
            self._begin(width)  # unchecked first, as for the rounds (autotuners, lazy buffers)
            torch.cuda.synchronize(self.rows.device)
            self._capture.warmup(lambda: self._begin(width), what=f"a prompt's prefill ({width} columns)")
            graph, _ = self._capture.capture(lambda: self._begin(width), what=f"a prompt's prefill ({width} columns)")
        except CaptureError as exc:  # loud: the prefills then run eagerly, the rounds stay captured
            self.prefill_failed = str(exc)
            warnings.warn(f"decode loop: a prompt's prefill cannot be captured as a CUDA graph; running prefills "
                          f"eagerly. {exc}", RuntimeWarning, stacklevel=4)
            return None
        self.prefill_graphs[width] = graph
        return graph

    # ------------------------------------------------------------------ a call
    def run(self, prompt: torch.Tensor, pad: torch.Tensor, max_new: int, min_new: int, min_length: int,
            streamer=None) -> tuple[torch.Tensor, AcceptanceStats | None]:
        """Generate for the rows of ``prompt [b, P]`` (``b`` <= the bucket; left padded by
        ``pad [b]``). Returns ``(sequences [b, P + new], stats)`` as ``generate`` returns them
        (rows that end early padded with the pad id).

        Raises:
            ValueError: the prompt's width (:meth:`prompt_width`), ``max_new`` and a window do not
                fit the buffers' capacity.
        """
        rows = self.rows
        b, P = prompt.shape
        self._ensure_graph()
        width = self.prompt_width(P)
        if width + max_new + self.k + 2 > rows.capacity:
            raise ValueError(f"decode loop: a prompt of {P} columns (run at {width}) and {max_new} new tokens do "
                             f"not fit the loop's {rows.capacity} columns")
        graph = self._prefill_graph(width)
        width = self.prompt_width(P)  # unrounded again if that capture failed
        for t in self.counters.values():
            t.zero_()
        rows.load(prompt, pad, max_new, min_new, min_length, width)
        if graph is not None:
            graph.replay()
        else:
            self._begin(width)
        sent = 0
        while True:
            # one read a batch of rounds: the rows' counts and flags in one copy to the host
            produced, finished = torch.stack((rows.produced[:b], rows.finished[:b].to(torch.int64))).tolist()
            done = all(finished)
            if streamer is not None:
                sent = self._stream(streamer, produced, finished, sent, width)
            if done:
                break
            left = min(max_new - p for p, f in zip(produced, finished) if not f)
            # a streamer is read after every replay (tokens as they come, a host read per round);
            # without one the host queues up to MAX_ROUNDS_PER_READ rounds between reads
            rounds = 1 if streamer is not None else max(1, min(MAX_ROUNDS_PER_READ, math.ceil(left / (self.k + 1))))
            for _ in range(math.ceil(rounds / self.per_graph)):
                if self.graph is not None:
                    self.graph.replay()
                    self.replays += 1
                else:
                    self._rounds()
                    self.eager_rounds += self.per_graph
        sequences = rows.tokens[:b, width - P:width + max(produced)].clone()
        return sequences, self._stats()

    def _stream(self, streamer, produced: list[int], finished: list[bool], sent: int, width: int) -> int:
        """Hand ``streamer`` the steps every row has made since step ``sent`` (a finished row's
        steps past its end are its pad id), as transformers' own loop streams them: at batch 1 the
        row's new tokens ``[n]``, at batch ``b`` one ``[b]`` tensor a step. Returns the steps
        handed over so far."""
        b = len(produced)
        running = [p for p, f in zip(produced, finished) if not f]
        ready = min(running) if running else max(produced)
        if ready > sent:
            block = self.rows.tokens[:b, width + sent:width + ready].cpu()
            for step in [block[0]] if b == 1 else block.t().contiguous().unbind(0):
                streamer.put(step)
        return max(sent, ready)

    def _stats(self) -> AcceptanceStats | None:
        if self.drafter is None:
            return None
        c = {name: t.tolist() for name, t in self.counters.items()}
        # positions no round offered (past every row's budget) are left out
        kept = sum(1 for o in c["offered"] if o > 0)
        c["offered"], c["per_position"] = c["offered"][:kept], c["per_position"][:kept]
        return AcceptanceStats(rounds=c["rounds"], empty_rounds=c["empty_rounds"], drafted=c["drafted"],
                               accepted=c["accepted"], per_position=c["per_position"], offered=c["offered"])
