"""``SpecDecodeGraphRunner``: the uniform spec-decode step captured as one CUDA graph per
batch-size bucket (docs/design.md section 6).

Per bucket one graph holds the model's verify forward for every layer, on-device acceptance
and the grouped commit. Inputs live in static buffers sized for the largest bucket; a call
copies the real rows in, pads the rest of the bucket with ``NULL_SLOT`` rows of zero-length
windows, replays the smallest bucket that fits, and returns views of the static outputs.
All buckets share one graph memory pool. Capture refuses a step that synchronises with the
host or allocates outside that pool, with a message that says which.

Off CUDA (or with ``capture=False``) the runner runs the same step body eagerly on the same
buffers, so its padding and bucketing behave identically everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import NULL_SLOT, StatePool
from ..capture import CaptureError, GraphCapture

from .step import spec_decode_step

__all__ = ["SpecDecodeGraphRunner", "CaptureError", "DEFAULT_BUCKETS"]

#: Batch-size buckets captured by default (capped by the pool's slot count).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class SpecDecodeGraphRunner:
    """Captured uniform spec-decode steps for a model and its state pool.

    Args:
        model: ``model(input_ids [T] int64, metadata, pool) -> logits [T, vocab]`` whose
            forward is capture-safe (static buffers, no host reads), e.g.
            :class:`ssm_spec.graphs.stack.DecoderStack`.
        pool: the model's :class:`~ssm_spec.StatePool` (its ``max_tokens`` must hold the
            largest bucket's ``B * W`` tokens). A folded pool (``StatePool(folded=True)``)
            gets two graphs per bucket, one per record-buffer parity, replayed alternately;
            rows it drops between steps must be flushed (``pool.flush``) before the next.
        num_draft_tokens: ``k``; every row's window is ``W = k + 1`` tokens.
        vocab_size: the logits' width (sizes ``draft_probs``).
        buckets: batch sizes to capture; those above ``pool.num_slots`` are dropped.
        sampling: capture rejection sampling (``step`` then takes ``draft_probs``) instead
            of greedy matching.
        temperature: the target's sampling temperature (sampling only; fixed at capture).
        generator: a CUDA generator for sampling (default: the device's default generator);
            registered with every graph so each replay draws fresh numbers.
        pad_token: filler of unused output positions and padded window positions.
        capture: capture CUDA graphs (default: when the pool is on CUDA); ``False`` runs the
            step eagerly on the static buffers.

    Raises:
        ValueError: ``num_draft_tokens < 0``, no bucket left, a pool too small for the largest
            bucket, a ``generator`` on another device, ``temperature <= 0`` for sampling,
            ``vocab_size < 1``, ``capture=True`` off CUDA, a pool spread over several devices
            (``pool.devices``: a graph holds one device's step; capture per device is not
            built). The model's logits width is checked against ``vocab_size`` by a
            padding-only step before the first real one (capture warm-up, or the first
            ``step``).
    """

    def __init__(self, model, pool: StatePool, num_draft_tokens: int, vocab_size: int, *,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, sampling: bool = False, temperature: float = 1.0,
                 generator: torch.Generator | None = None, pad_token: int = 0, capture: bool | None = None):
        if num_draft_tokens < 0:
            raise ValueError(f"SpecDecodeGraphRunner: num_draft_tokens: got {num_draft_tokens}; expected >= 0")
        self.buckets = tuple(sorted({int(b) for b in buckets if 1 <= int(b) <= pool.num_slots}))
        if not self.buckets:
            raise ValueError(f"SpecDecodeGraphRunner: buckets: none of {list(buckets)} fits the pool's "
                             f"{pool.num_slots} slots")
        self.W = W = num_draft_tokens + 1
        bmax = self.buckets[-1]
        if pool.max_tokens < bmax * W:
            raise ValueError(f"SpecDecodeGraphRunner: pool.max_tokens: got {pool.max_tokens}; expected >= "
                             f"{bmax * W} (the largest bucket, {bmax} rows of {W} tokens)")
        if sampling and not temperature > 0:
            raise ValueError(f"SpecDecodeGraphRunner: temperature: got {temperature}; expected > 0")
        if vocab_size < 1:
            raise ValueError(f"SpecDecodeGraphRunner: vocab_size: got {vocab_size}; expected >= 1")
        if pool.spread:
            raise ValueError(f"SpecDecodeGraphRunner: the pool spans {', '.join(map(str, pool.devices))}; a CUDA "
                             "graph holds the step of one device (run a model spread over devices eagerly)")
        if capture and pool.device.type != "cuda":
            raise ValueError(f"SpecDecodeGraphRunner: capture=True needs a CUDA pool; the pool is on {pool.device}")
        self.model, self.pool, self.vocab_size = model, pool, vocab_size
        self.sampling, self.temperature, self.generator, self.pad_token = sampling, temperature, generator, pad_token
        dev = self.device = pool.device
        if generator is not None and generator.device.type != dev.type:
            raise ValueError(f"SpecDecodeGraphRunner: generator: on {generator.device}; expected {dev}")
        self.capture_graphs = dev.type == "cuda" if capture is None else bool(capture)
        i32 = dict(dtype=torch.int32, device=dev)
        # static inputs (padding values: a NULL_SLOT row with a zero-length window)
        self.window_tokens = torch.full((bmax, W), pad_token, dtype=torch.int64, device=dev)
        self.window_lens = torch.zeros(bmax, **i32)
        self.state_indices = torch.full((bmax,), NULL_SLOT, **i32)
        self.num_computed_tokens = torch.zeros(bmax, **i32)
        self.query_start_loc = torch.arange(bmax + 1, **i32) * W
        self.draft_probs = torch.zeros(bmax, W - 1, vocab_size, device=dev) if sampling else None
        # static outputs
        self.accepted_tokens = torch.full((bmax, W), pad_token, dtype=torch.int64, device=dev)
        self.num_accepted_tokens = torch.zeros(bmax, **i32)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, record parity)
        self._vocab_checked = False
        self._capture = GraphCapture(dev, "SpecDecodeGraphRunner") if self.capture_graphs else None

    # ------------------------------------------------------------------ the step body
    def _body(self, B: int) -> None:
        """The step on the first ``B`` rows of the static buffers (captured or eager)."""
        accepted, counts = spec_decode_step(
            self.model, self.pool, self.window_tokens[:B], self.window_lens[:B], self.state_indices[:B],
            self.num_computed_tokens[:B], self.query_start_loc[:B + 1],
            self.draft_probs[:B] if self.sampling else None,
            temperature=self.temperature, generator=self.generator, pad_token=self.pad_token,
            vocab_size=self.vocab_size)
        self.accepted_tokens[:B].copy_(accepted)
        self.num_accepted_tokens[:B].copy_(counts)

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket holding ``batch`` rows.

        Raises:
            ValueError: ``batch`` outside ``1..max bucket``.
        """
        for b in self.buckets:
            if b >= batch >= 1:
                return b
        raise ValueError(f"SpecDecodeGraphRunner: batch: got {batch} rows; expected 1..{self.buckets[-1]}")

    # ------------------------------------------------------------------ capture
    def _pad(self, start: int = 0, stop: int | None = None) -> None:
        """Make rows ``[start, stop)`` of the static inputs padding: a ``NULL_SLOT`` row with a
        zero-length window (reads and writes nothing)."""
        rows = slice(start, stop)
        self.window_tokens[rows].fill_(self.pad_token)
        self.window_lens[rows].zero_()
        self.state_indices[rows].fill_(NULL_SLOT)
        self.num_computed_tokens[rows].zero_()
        if self.sampling:
            self.draft_probs[rows].fill_(1.0 / self.vocab_size)

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> SpecDecodeGraphRunner:
        """Capture one graph per bucket, largest first, into one shared memory pool.

        Every bucket first runs ``warmup`` times eagerly on a side stream with only padding
        rows (kernels compile, libraries set up their workspaces; no state changes: padding
        rows read and write nothing). A no-op when the runner does not capture.

        Raises:
            CaptureError: the step synchronised with the host or used an operation CUDA
                graphs forbid (the CUDA error is chained), or it allocated memory outside the
                graph pool during capture (sizes and count given).
        """
        if not self.capture_graphs or self.graphs:
            return self
        parity = self.pool.record_parity  # warm-ups and captures swap a folded pool's records
        self._check_vocab()
        self._pad()
        for B in self.buckets:
            self._capture.warmup(lambda B=B: self._body(B), warmup, what=f"bucket {B}")
        torch.cuda.synchronize(self.device)
        for B in reversed(self.buckets):
            for p in self._parities():
                if self.pool.double_buffered:
                    self.pool.set_record_parity(p)  # the step's commit swaps it while capturing
                self.graphs[(B, p)] = self._capture_one(B)
        if self.pool.double_buffered:
            self.pool.set_record_parity(parity)
        torch.cuda.synchronize(self.device)
        return self

    def _parities(self) -> tuple[int, ...]:
        """A folded pool double-buffers its records: one graph per buffer parity."""
        return (0, 1) if self.pool.double_buffered else (0,)

    def graph_for(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The captured graph a step of ``bucket`` rows replays now (a folded pool: the one for
        the current record parity)."""
        return self.graphs[(bucket, self.pool.record_parity if self.pool.double_buffered else 0)]

    def replay(self, bucket: int) -> None:
        """Replay ``bucket``'s graph on the static buffers as they are (a folded pool's record
        buffers swap, as the step's commit would)."""
        self.graph_for(bucket).replay()
        if self.pool.double_buffered:
            self.pool.swap_records()

    def _capture_one(self, B: int) -> torch.cuda.CUDAGraph:
        graph, _ = self._capture.capture(lambda: self._body(B), what=f"bucket {B}", generator=self.generator)
        return graph

    @torch.no_grad()
    def _check_vocab(self) -> None:
        """Run the body once on padding rows only (reads and writes no state) so a model whose
        logits are not ``vocab_size`` wide fails here, not in the middle of a real step."""
        if self._vocab_checked:
            return
        parity = self.pool.record_parity
        self._pad()  # callers load their rows afterwards
        try:
            self._body(self.buckets[0])
        except ValueError as exc:
            raise ValueError(f"SpecDecodeGraphRunner: {exc}") from None
        finally:
            if self.pool.double_buffered:  # the probe's commit swapped the record buffers: undo it
                self.pool.set_record_parity(parity)
        self._vocab_checked = True

    # ------------------------------------------------------------------ a step
    def _check(self, window_tokens, window_lens, state_indices, num_computed_tokens, draft_probs) -> None:
        W, V = self.W, self.vocab_size
        if window_tokens.dim() != 2:
            raise ValueError(f"SpecDecodeGraphRunner.step: window_tokens: got shape {list(window_tokens.shape)}; "
                             f"expected [B, {W}]")
        B = window_tokens.shape[0]
        for name, t in (("window_tokens", window_tokens), ("window_lens", window_lens),
                        ("state_indices", state_indices), ("num_computed_tokens", num_computed_tokens)):
            if t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"SpecDecodeGraphRunner.step: {name}: got dtype {t.dtype}; expected int32 or int64")
        if draft_probs is not None and not draft_probs.is_floating_point():
            raise ValueError(f"SpecDecodeGraphRunner.step: draft_probs: got dtype {draft_probs.dtype}; expected a "
                             "floating dtype")
        shapes = {"window_tokens": (window_tokens, (B, W)), "window_lens": (window_lens, (B,)),
                  "state_indices": (state_indices, (B,)), "num_computed_tokens": (num_computed_tokens, (B,))}
        if self.sampling:
            if draft_probs is None:
                raise ValueError("SpecDecodeGraphRunner.step: draft_probs: got None; expected "
                                 f"[B, {W - 1}, {V}] (the runner samples)")
            shapes["draft_probs"] = (draft_probs, (B, W - 1, V))
        elif draft_probs is not None:
            raise ValueError("SpecDecodeGraphRunner.step: draft_probs given to a greedy runner "
                             "(construct it with sampling=True)")
        for name, (t, shape) in shapes.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"SpecDecodeGraphRunner.step: {name}: got shape {list(t.shape)}; expected "
                                 f"{list(shape)} (W = {W})")
        self.bucket_for(B)

    @staticmethod
    def _check_draft_probs(window_tokens, window_lens, draft_probs) -> None:
        """Each real draft's distribution: finite, non-negative, summing to 1 (within 1e-3), and
        giving its own draft a positive probability (it was drawn from it)."""
        q = draft_probs.double()
        if not torch.isfinite(q).all() or (q < 0).any():
            raise ValueError("SpecDecodeGraphRunner.step: draft_probs: got negative or non-finite entries; "
                             "expected probabilities")
        k = q.shape[1]
        real = torch.arange(k, device=q.device)[None, :] < (window_lens.to(q.device).long() - 1)[:, None]
        sums = q.sum(-1)
        if ((sums - 1).abs() > 1e-3)[real].any():
            raise ValueError("SpecDecodeGraphRunner.step: draft_probs: a real draft's distribution does not sum "
                             "to 1 (within 1e-3)")
        q_x = q.gather(2, window_tokens[:, 1:].long().to(q.device)[..., None])[..., 0]
        if (q_x <= 0)[real].any():
            raise ValueError("SpecDecodeGraphRunner.step: draft_probs: a draft token has probability 0 under its "
                             "own draft distribution (it cannot have been drawn from it)")

    @staticmethod
    def _check_values(W, vocab, slots_total, window_tokens, window_lens, state_indices, num_computed_tokens):
        lens, slots = window_lens.tolist(), state_indices.tolist()
        nct = num_computed_tokens.tolist()
        seen = set()
        for b, (n, s, c) in enumerate(zip(lens, slots, nct)):
            if s < 0:
                if n:
                    raise ValueError(f"SpecDecodeGraphRunner.step: window_lens[{b}]: got {n} for a padding row "
                                     f"(state_indices[{b}] = {s}); expected 0")
                continue
            if s >= slots_total:
                raise ValueError(f"SpecDecodeGraphRunner.step: state_indices[{b}]: got {s}; expected < "
                                 f"{slots_total}")
            if s in seen:
                raise ValueError(f"SpecDecodeGraphRunner.step: state_indices[{b}]: slot {s} appears twice")
            seen.add(s)
            if not 1 <= n <= W:
                raise ValueError(f"SpecDecodeGraphRunner.step: window_lens[{b}]: got {n}; expected 1..{W}")
            if c < 1:
                raise ValueError(f"SpecDecodeGraphRunner.step: num_computed_tokens[{b}]: got {c}; expected >= 1 "
                                 "(prefill runs outside the uniform step)")
        lo, hi = int(window_tokens.min()), int(window_tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"SpecDecodeGraphRunner.step: window_tokens: got values in [{lo}, {hi}]; expected "
                             f"0..{vocab - 1}")

    @torch.no_grad()
    def step(self, window_tokens: torch.Tensor, window_lens: torch.Tensor, state_indices: torch.Tensor,
             num_computed_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
             validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step for ``B`` rows: copy them into the static buffers, pad to the smallest
        bucket, replay its graph (or run the body eagerly), and return the outputs.

        Args:
            window_tokens: ``[B, W]`` int64/int32 token ids in ``0..vocab_size - 1`` (every
                position, padding rows' too; positions past a row's length are verified but
                never accepted).
            window_lens: ``[B]`` int, ``1..W`` real tokens (``0`` with ``NULL_SLOT``: padding).
            state_indices: ``[B]`` int slots, distinct; ``NULL_SLOT`` for padding rows.
            num_computed_tokens: ``[B]`` int committed tokens per row (``>= 1``: prefill first).
            draft_probs: ``[B, W - 1, vocab]`` (sampling runners only).
            validate: check the values on the host first (one device-to-host read of the small
                index tensors, and of ``draft_probs``: finite, non-negative, summing to 1, each
                draft possible under its own distribution). Shapes and dtypes are always checked.

        Returns:
            ``(accepted_tokens [B, W] int64, num_accepted_tokens [B] int32)``: views of the
            static outputs, valid until the next step (clone to keep them).

        Raises:
            ValueError: a shape or (with ``validate``) a value out of contract; raised before
                any buffer or state is written.
        """
        self._check(window_tokens, window_lens, state_indices, num_computed_tokens, draft_probs)
        if validate:
            self._check_values(self.W, self.vocab_size, self.pool.num_slots, window_tokens, window_lens,
                               state_indices, num_computed_tokens)
            if self.sampling:
                self._check_draft_probs(window_tokens, window_lens, draft_probs)
        self._check_vocab()
        if self.capture_graphs and not self.graphs:
            self.capture()  # first: capturing pads every static buffer
        B = window_tokens.shape[0]
        bucket = self.bucket_for(B)
        self.window_tokens[:B].copy_(window_tokens)
        self.window_lens[:B].copy_(window_lens)
        self.state_indices[:B].copy_(state_indices)
        self.num_computed_tokens[:B].copy_(num_computed_tokens)
        if self.sampling:
            self.draft_probs[:B].copy_(draft_probs)
        if bucket > B:
            self._pad(B, bucket)
        if self.capture_graphs:
            self.replay(bucket)
        else:
            self._body(bucket)
        return self.accepted_tokens[:B], self.num_accepted_tokens[:B]

    @torch.no_grad()
    def eager_step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step body eagerly on the static buffers as they are, for ``bucket`` rows (the
        reference a replay must equal bit for bit)."""
        self._body(bucket)
        return self.accepted_tokens[:bucket], self.num_accepted_tokens[:bucket]
