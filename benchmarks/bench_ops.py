"""Benchmark the GDN ops against the device's copy bandwidth and fp32 FMA rate.

One run measures two ceilings:

* the device-to-device copy bandwidth (a large ``dst.copy_(src)``, bytes = read + write);
* the fp32 FMA rate (a plain kernel running independent chains of FMAs on a large tensor:
  Triton on CUDA, ``torch.addcmul`` on CPU), in fp32 ops/s (one FMA = one op = 2 FLOPs);

and, for every draft length k in ``--k`` (window W = k + 1) and every batch size B (B rows,
each a uniform window of W tokens):

* ``torch.ops.ssm_spec.gdn_verify``: the RecoverSSM verify (reads the checkpoint, writes the
  layer output and the fp32 replay record, no state written);
* ``torch.ops.ssm_spec.gdn_commit`` with every token accepted (n = W) and with n = 1, in place
  (dst = src);
* ``torch.ops.ssm_spec.gdn_snapshot_verify``: the native path, writing the state after each
  of the W tokens into its own slot, on its own tile table (bits do not depend on tiles);
* ``native_engine``: the native spec-decode kernel engines ship (``native_engine.py``: one
  program per 8-wide V slice and (row, value head), one warp, every token's state into its own
  slot), the second baseline;
* ``torch.ops.ssm_spec.gdn_folded_verify``: the previous window (W tokens, all accepted) folded
  into the checkpoint, stored once, then this window verified; its records and the previous
  ones are different copies (double-buffered);
* an outside peer, fla-core's ``fused_recurrent_gated_delta_rule`` (CUDA only, imported
  lazily, skipped with a note when missing) over the same B rows x W tokens from the same
  states, writing the output and an fp32 final state: ``fla`` gathers the rows' states by
  index (``index_select``, timed; or passes ``ssm_state_indices`` where the installed version
  takes them) and ``fla_contig`` hands it the rows' slots as one contiguous block (its kernel
  alone);

and reports median times, the bytes each op must move (``BYTES_MODEL``) and the fp32 ops it
must do (``OPS_MODEL``), the fraction of its roofline floor ``max(bytes / copy bandwidth,
ops / FMA rate) / time``, the achieved bandwidth as a fraction of the copy bandwidth, and the
ratios ``(verify + commit) / snapshot`` (n = W and n = 1) and ``folded / snapshot``.

The ops are called through their ``torch.ops`` forms with preallocated buffers, so no
allocation or host-side value validation is timed. State pages are kept out of the L2 cache:
the pool holds at least ``--pool-gib`` GiB and ``--min-sets`` times what the largest batch
(at the largest W) touches, and successive calls rotate over disjoint index sets (plus
``do_bench`` flushes L2 before every timed call). On CUDA, by default (``--timing graph``),
each measurement captures a CUDA graph of up to ``--graph-calls`` calls over distinct index
sets and times its replay with ``triton.testing.do_bench`` (median), dividing by the number of
calls: this removes the Python launch overhead of small batches, as in the engine's
full-graph decode step. ``--timing eager`` times single eager calls instead.

``--device cpu`` is a smoke test of this script only (tiny sizes, ``time.perf_counter``).

Results (JSON and plot) go to ``benchmarks/out/`` (git-ignored) unless asked otherwise: ``--save``
writes ``benchmarks/results/``, the committed GPU runs (refused for a CPU or ``--quick`` smoke
run), ``--out-dir DIR`` writes DIR. The output's first lines say where.

Usage::

    python benchmarks/bench_ops.py --save                   # H200, fp32 state, k = 1,2,3,5,7, committed
    python benchmarks/bench_ops.py --state-dtype bfloat16
    python benchmarks/bench_ops.py --k 3 --batches 1,16,256
    python benchmarks/bench_ops.py --device cpu             # smoke test of the script
    python benchmarks/bench_ops.py --replot benchmarks/results/bench_ops_nvidia-h200_float32.json  # redraw
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import (HelpFormatter, add_out_args, device_name, pyplot, resolve_out_dir, slug,
                      write_results)

import ssm_spec  # noqa: F401  (registers torch.ops.ssm_spec.*)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the CPU smoke test still runs (torch FMA loop)
    triton = tl = None

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNELS = ("verify", "commit_nW", "commit_n1", "snapshot", "native_engine", "folded", "closed_form_verify",
           "closed_form_folded", "lazy")
#: Fast mode's lazy commit as benchmarked: ``max_pending`` and the accepted tokens per step
#: (``W - 1``: 3 of 4 at k=3); its time is the mean over one fold cycle (:func:`lazy_phases`).
LAZY_MAX_PENDING = 16
PEER_KERNELS = ("fla", "fla_contig")
LABELS = {
    "verify": "verify", "commit_nW": "commit n=W", "commit_n1": "commit n=1",
    "snapshot": "snapshot (native)",
    "folded": "folded verify (n_prev=W)",
    "native_engine": "engine's native kernel (8-wide V slice, 1 warp)",
    "closed_form_verify": "closed-form verify (fast)",
    "closed_form_folded": "closed-form folded (fast, n_prev=W)",
    "lazy": f"lazy (fast, L={LAZY_MAX_PENDING}, W-1 accepted)",
    "fla": "fla fused_recurrent", "fla_contig": "fla fused_recurrent, contiguous h0",
}
GIB = 1 << 30


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
FMA_CHAINS = 4  # independent FMA chains per element in the FMA kernel

#: Minimum bytes each op must move (DRAM traffic of an ideal kernel), per layer and step.
#: Unique bytes are counted once (a key head shared by several value heads is read once);
#: the index/metadata tensors (a few bytes per row) are left out.
BYTES_MODEL = {
    "notation": "B rows, W = k + 1 tokens per row, T = B * W; es = state element size, "
                "ea = activation element size (q, k, v, beta, out); records and g are fp32",
    "slot": "HV * K * V * es  (one state slot)",
    "slot32": "HV * K * V * 4  (one fp32 state: fla's final state)",
    "act_in": "T * ((2*H*K + HV*V) * ea + HV * 4 + HV * ea)  (q, k, v; g fp32; beta)",
    "out": "T * HV * V * ea",
    "record_per_token": "(HV*V + H*K + HV) * 4  (u, k_hat, decay; fp32)",
    "verify": "B * slot + act_in + out + T * record_per_token  (read checkpoint; write out "
              "and the record)",
    "commit(n)": "2 * B * slot + B * n * record_per_token  (read src, write dst; read n "
                 "records per row)",
    "snapshot": "B * slot + T * slot + act_in + out  (read src; write W slots per row; "
                "write out)",
    "native_engine": "as snapshot (the engines' kernel: read the last accepted token's slot, "
                     "write every token's state into its own slot)",
    "folded": "B * slot + B * slot + act_in + out + T * record_per_token + B * W * "
              "record_per_token  (read the checkpoint, store the committed state once; write "
              "out and the record; read the previous window's W records per row)",
    "fla": "gather: 2 * B * slot + B * slot + act_in + out + B * slot32  (index_select of the "
           "rows' states: read + write; fla reads them, writes out and an fp32 final state); "
           "indexed (an fla taking ssm_state_indices): B * slot + act_in + out + B * slot",
    "fla_contig": "B * slot + act_in + out + B * slot32  (fla on the rows' slots as one "
                  "contiguous block: no gather)",
    "closed_form_verify": "as verify (fast mode: the state read once, contracted in closed form)",
    "closed_form_folded": "as folded with the ring's records: the checkpoint read, the fold of the W pending "
                          "tokens stored once, the window verified (max_pending = 1, all W accepted)",
    "lazy": "mean over one fold cycle (max_pending = 16, W - 1 accepted per step) of: B * slot + act_in + out + "
            "T * record_per_token + B * p * record_per_token (read the p pending records), plus B * slot on the "
            "step that folds",
    "copy": "2 * nbytes  (read + write)",
}

#: fp32 arithmetic each op must do, counted per state element (E = HV * K * V per row) as
#: instructions: an FMA or a multiply is one op (the FMA kernel's rate is in the same unit;
#: FLOP/s = 2 * ops/s for FMAs).
OPS_MODEL = {
    "unit": "fp32 ops (one FMA or multiply = 1) per state element; E = HV * K * V",
    "verify": "4 * T * E  (per token: decay, correction reduction, rank-1 update, output "
              "reduction)",
    "commit(n)": "2 * B * n * E  (per replayed token: decay and rank-1 update)",
    "snapshot": "4 * T * E",
    "folded": "2 * B * W * E + 4 * T * E  (fold of the W previous tokens, then the verify)",
    "fla": "4 * T * E",
    "fla_contig": "4 * T * E",
    "closed_form_verify": "2 * T * E  (the window's 2W keys and queries against the state; the W x W solve and "
                          "the q/k Gram rows are O(W^2 (K + V)) per head and left out)",
    "closed_form_folded": "2 * B * W * E + 2 * T * E",
    "lazy": "2 * T * E per step, plus 2 * B * p * E on the step that folds p tokens (cycle mean)",
    "fma": f"n * iters * {FMA_CHAINS} FMAs on n fp32 elements (CPU: n * iters addcmul ops)",
    "roofline": "floor_us = max(bytes / copy bandwidth, ops / FMA rate); "
                "frac_roofline = floor_us / time_us; bound: which term sets the floor",
}


# ----------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class Shape:
    H: int
    HV: int
    K: int
    V: int
    W: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        return self.HV * self.K * self.V * self.state_dtype.itemsize

    @property
    def record_bytes_per_token(self) -> int:
        return (self.HV * self.V + self.H * self.K + self.HV) * 4

    def bytes_moved(self, B: int, peer_mode: str | None = None) -> dict[str, int]:
        """``BYTES_MODEL`` evaluated for ``B`` rows of ``W`` tokens."""
        H, HV, K, V, W = self.H, self.HV, self.K, self.V, self.W
        ea = self.act_dtype.itemsize
        T = B * W
        slot = self.slot_bytes
        slot32 = HV * K * V * 4
        act_in = T * ((2 * H * K + HV * V) * ea + HV * 4 + HV * ea)
        out = T * HV * V * ea
        rec_tok = self.record_bytes_per_token
        moved = {
            "verify": B * slot + act_in + out + T * rec_tok,
            "commit_nW": 2 * B * slot + B * W * rec_tok,
            "commit_n1": 2 * B * slot + B * 1 * rec_tok,
            "snapshot": B * slot + T * slot + act_in + out,
            "folded": 2 * B * slot + act_in + out + T * rec_tok + B * W * rec_tok,
            "fla_contig": B * slot + act_in + out + B * slot32,
        }
        moved["native_engine"] = moved["snapshot"]  # the same traffic, the engines' structure
        moved["closed_form_verify"] = moved["verify"]
        moved["closed_form_folded"] = moved["folded"]
        phases = lazy_phases(W)
        moved["lazy"] = sum(B * slot + act_in + out + T * rec_tok + B * p * rec_tok + (B * slot if fold else 0)
                            for p, fold in phases) / len(phases)
        if peer_mode == "indexed":
            moved["fla"] = 2 * B * slot + act_in + out
        else:
            moved["fla"] = 2 * B * slot + B * slot + act_in + out + B * slot32
        return moved

    def ops(self, B: int) -> dict[str, int]:
        """``OPS_MODEL`` evaluated for ``B`` rows of ``W`` tokens."""
        E, W = self.HV * self.K * self.V, self.W
        T = B * W
        ops = {
            "verify": 4 * T * E,
            "commit_nW": 2 * B * W * E,
            "commit_n1": 2 * B * 1 * E,
            "snapshot": 4 * T * E,
            "folded": 2 * B * W * E + 4 * T * E,
            "fla": 4 * T * E,
            "fla_contig": 4 * T * E,
        }
        ops["native_engine"] = ops["snapshot"]
        ops["closed_form_verify"] = 2 * T * E
        ops["closed_form_folded"] = 2 * B * W * E + 2 * T * E
        phases = lazy_phases(W)
        ops["lazy"] = sum(2 * T * E + (2 * B * p * E if fold else 0) for p, fold in phases) / len(phases)
        return ops


def ring_memory(shape: Shape, W: int) -> dict:
    """The lazy commit's records per slot as a fraction of one fp32 state, for max_pending
    L = 4, 8, 16: ``pending`` (the L records a slot keeps) and ``ring`` (the positions it
    allocates, ``max(L, W) + W``)."""
    from ssm_spec.ops.gdn.closed_form import ring_positions

    state = shape.HV * shape.K * shape.V * 4
    tok = shape.record_bytes_per_token
    return {L: {"pending": L * tok / state, "ring": ring_positions(L, W) * tok / state} for L in (4, 8, 16)}


def lazy_phases(W: int, max_pending: int = LAZY_MAX_PENDING) -> list[tuple[int, bool]]:
    """One fold cycle of the lazy commit with ``W - 1`` tokens accepted per step: the pending
    count ``p`` at each step's verify and whether that step folds (``p > 0 and p + W >
    max_pending``); e.g. W=4, 16: p = 0, 3, 6, 9, 12 read the state only, p = 15 folds."""
    accepted, p, phases = max(W - 1, 1), 0, []
    while True:
        fold = p > 0 and p + W > max_pending
        phases.append((p, fold))
        if fold:
            return phases
        p += accepted


def aligned_rows(values: torch.Tensor) -> list[torch.Tensor]:
    """The rows of ``values [n, m]`` as views that each start on a 16-byte boundary, so every
    index set gets the same Triton pointer-alignment specialization (no recompiles)."""
    n, m = values.shape
    padded = torch.full((n, -(-m // 4) * 4), -1, dtype=values.dtype, device=values.device)
    padded[:, :m] = values
    return [padded[i, :m] for i in range(n)]


@dataclass
class Peer:
    """fla-core's ``fused_recurrent_gated_delta_rule`` and how it is called: ``mode``
    ``"indexed"`` (the installed version takes ``ssm_state_indices``: states read from and
    written to the pool by index) or ``"gather"`` (``initial_state`` gathered by
    ``index_select``; fp32 final state returned)."""

    fn: object
    mode: str
    version: str | None
    params: tuple[str, ...]


def load_peer(device: torch.device, enabled: bool) -> tuple[Peer | None, str]:
    """The fla-core peer, or None and why not. Imported lazily: fla-core is the `cuda` extra,
    never installed on CPU machines."""
    if not enabled:
        return None, "fla-core peer disabled (--no-peer)"
    if device.type != "cuda":
        return None, "fla-core peer skipped: its Triton kernels need CUDA"
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
    except Exception as exc:  # not installed, or broken against this torch/triton
        return None, f"fla-core peer skipped: not importable ({type(exc).__name__}: {exc})"
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        version = None
    params = tuple(inspect.signature(fn).parameters)
    mode = "indexed" if "ssm_state_indices" in params else "gather"
    return Peer(fn, mode, version, params), (
        f"fla-core {version}: fused_recurrent_gated_delta_rule, initial states "
        + ("by ssm_state_indices" if mode == "indexed" else "gathered by index_select (timed)"))


class BatchWorkload:
    """Buffers and the op calls for one batch size.

    Index set ``i`` owns the slot block ``[i * B * (W + 1), (i + 1) * B * (W + 1))`` of the
    pool: its first ``B`` slots are the rows' sources (checkpoints), the next ``T = B * W``
    the snapshot slots of token ``t`` (never any row's source). Activations, outputs and
    records come in ``n_act`` copies; call ``i`` uses set ``i`` and copy ``i % n_act``. The
    folded verify writes record copy ``j`` and replays copy ``j + 1`` (mod ``n_act``; a
    separate copy when ``n_act == 1``) as the previous step's: double-buffered.
    """

    def __init__(self, shape: Shape, pool: torch.Tensor, B: int, n_sets: int, n_act: int,
                 peer: Peer | None = None):
        H, HV, K, V, W = shape.H, shape.HV, shape.K, shape.V, shape.W
        dev, act = pool.device, shape.act_dtype
        T = B * W
        self.pool, self.n_sets, self.scale = pool, n_sets, K**-0.5
        self.B, self.W, self.block = B, W, B * (W + 1)
        i32 = dict(dtype=torch.int32, device=dev)

        # q | k | v as strided views of one conv output [T, 2*H*K + HV*V].
        conv = torch.randn(n_act, T, 2 * H * K + HV * V, dtype=act, device=dev)
        q = conv[..., : H * K].unflatten(-1, (H, K))
        k = conv[..., H * K : 2 * H * K].unflatten(-1, (H, K))
        v = conv[..., 2 * H * K :].unflatten(-1, (HV, V))
        g = -F.softplus(torch.randn(n_act, T, HV, dtype=torch.float32, device=dev))
        beta = torch.sigmoid(torch.randn(n_act, T, HV, dtype=torch.float32, device=dev)).to(act)
        out = torch.empty(n_act, T, HV, V, dtype=act, device=dev)
        rec_u = torch.empty(n_act, T, HV, V, dtype=torch.float32, device=dev)
        rec_k = torch.empty(n_act, T, H, K, dtype=torch.float32, device=dev)
        rec_d = torch.empty(n_act, T, HV, dtype=torch.float32, device=dev)
        self.window = [(q[j], k[j], v[j], g[j], beta[j]) for j in range(n_act)]
        self.out = list(out.unbind(0))
        self.record = list(zip(rec_u.unbind(0), rec_k.unbind(0), rec_d.unbind(0)))
        self._keep = (conv, g, beta, out, rec_u, rec_k, rec_d)

        self.qsl = torch.arange(B + 1, **i32) * W
        base = torch.arange(n_sets, **i32)[:, None] * self.block
        self.src = aligned_rows(base + torch.arange(B, **i32))           # [B] per set
        self.snap = aligned_rows(base + B + torch.arange(T, **i32))      # [T] per set
        self.n_all = torch.full((B,), W, **i32)
        self.n_one = torch.ones(B, **i32)
        self.no_bnd = torch.empty(B, 0, **i32)
        self.prev_start = torch.arange(B, **i32) * W  # row b's previous window: tokens [bW, bW + W)
        self.n_act = n_act

        # Fast mode: per-slot record rings (random records; the kernels' time does not depend
        # on their values), ``max_pending = 1`` for the folded form, 16 for the lazy commit.
        from ssm_spec.ops.gdn.closed_form import RecordRing, ring_positions

        S = pool.shape[0]
        self.ring = {}
        for name, max_pending in (("closed_form_folded", 1), ("lazy", LAZY_MAX_PENDING)):
            R = ring_positions(max_pending, W)
            ring = RecordRing.zeros(S, R, H, HV, K, V, dev)
            ring.u.normal_()
            ring.k.normal_()
            ring.k.div_(ring.k.norm(dim=-1, keepdim=True))
            ring.g.normal_().abs_().neg_()
            self.ring[name] = (ring, max_pending)
        self.zeros_b = torch.zeros(B, **i32)

        # Real records for the commits and the fold: one verify per activation copy (also
        # compiles), plus a separate previous-step copy when there is a single one.
        for j in range(n_act):
            self.verify(j)
        if n_act == 1:
            self.prev_record = tuple(torch.empty_like(r) for r in self.record[0])
            torch.ops.ssm_spec.gdn_verify(*self.window[0], pool, self.src[0], self.qsl,
                                          self.out[0], *self.prev_record, self.scale, True)

        # The peer's inputs: contiguous [B, W, ...] copies of the same activations (fla's
        # kernel assumes contiguous q, k, v; handing it the strided views would time a copy).
        self.peer = peer
        if peer is not None:
            qf = q.contiguous().view(n_act, B, W, H, K)
            kf = k.contiguous().view(n_act, B, W, H, K)
            vf = v.contiguous().view(n_act, B, W, HV, V)
            gf, bf = g.view(n_act, B, W, HV), beta.view(n_act, B, W, HV)
            self.fla_in = [(qf[j], kf[j], vf[j], gf[j], bf[j]) for j in range(n_act)]
            self.fla_flat = [tuple(x.flatten(0, 1).unsqueeze(0) for x in w) for w in self.fla_in]
            self.qsl_long = self.qsl.to(torch.int64)
            self._keep_peer = (qf, kf, vf)

    def verify(self, i: int) -> None:
        j = i % self.n_act
        torch.ops.ssm_spec.gdn_verify(*self.window[j], self.pool, self.src[i], self.qsl,
                                      self.out[j], *self.record[j], self.scale, True)

    def commit(self, i: int, n: torch.Tensor) -> None:
        src = self.src[i]
        torch.ops.ssm_spec.gdn_commit(self.pool, *self.record[i % self.n_act], self.qsl, src, n,
                                      src, self.no_bnd, self.no_bnd)

    def snapshot(self, i: int) -> None:
        j = i % self.n_act
        torch.ops.ssm_spec.gdn_snapshot_verify(*self.window[j], self.pool, self.src[i], self.qsl,
                                               self.snap[i], self.out[j], self.scale, True)

    def native_engine(self, i: int) -> None:
        """The engines' native kernel (``native_engine.py``): set ``i``'s snapshot slots as
        the rows' per-token slots ``[B, W]``, the checkpoint read from the last one (all W
        tokens of the previous step accepted), every token's state written in place."""
        from native_engine import native_engine_verify

        j = i % self.n_act
        native_engine_verify(*self.window[j], self.pool, self.snap[i].view(self.B, self.W), self.n_all,
                             self.out[j], self.scale, True)

    def folded(self, i: int) -> None:
        """Fold the previous window (all W tokens accepted, from the other record copy) into
        the checkpoint, store it, verify this window into record copy ``j``."""
        j = i % self.n_act
        prev = self.record[(j + 1) % self.n_act] if self.n_act > 1 else self.prev_record
        torch.ops.ssm_spec.gdn_folded_verify(*self.window[j], self.pool, self.src[i], self.qsl,
                                             self.out[j], *self.record[j], *prev,
                                             self.prev_start, self.n_all, self.scale, True)

    def closed_form_verify(self, i: int) -> None:
        j = i % self.n_act
        torch.ops.ssm_spec.gdn_closed_form_verify(*self.window[j], self.pool, self.src[i], self.qsl, self.out[j],
                                                  *self.record[j], self.W, self.scale, True)

    def lazy_verify(self, i: int, name: str, count: torch.Tensor) -> None:
        """Fast mode's folded verify on ring ``name`` with every row ``count`` tokens pending from
        ring position 0 (the kernel reads the counts; the pool's commit would move them)."""
        j = i % self.n_act
        ring, max_pending = self.ring[name]
        torch.ops.ssm_spec.gdn_closed_form_folded_verify(*self.window[j], self.pool, self.src[i], self.qsl,
                                                         self.out[j], *ring, self.zeros_b, count, self.W,
                                                         max_pending, self.scale, True)

    def lazy_calls(self) -> dict:
        """``{p: call}`` over one fold cycle of the lazy commit (:func:`lazy_phases`)."""
        counts = {p: torch.full_like(self.zeros_b, p) for p, _ in lazy_phases(self.W)}
        return {p: (lambda i, c=c: self.lazy_verify(i, "lazy", c)) for p, c in counts.items()}

    def fla(self, i: int):
        """fla-core over the same rows and window; states by index (see :class:`Peer`)."""
        j, peer = i % self.n_act, self.peer
        if peer.mode == "indexed":
            q, k, v, g, beta = self.fla_flat[j]  # [1, T, ...] with cu_seqlens
            kw = dict(initial_state=self.pool, ssm_state_indices=self.src[i],
                      cu_seqlens=self.qsl_long)
            if "inplace_final_state" in peer.params:
                kw["inplace_final_state"] = True
            else:
                kw["output_final_state"] = True
        else:
            q, k, v, g, beta = self.fla_in[j]  # [B, W, ...]
            kw = dict(initial_state=self.pool.index_select(0, self.src[i]),
                      output_final_state=True)
        return peer.fn(q=q, k=k, v=v, g=g, beta=beta, scale=self.scale,
                       use_qk_l2norm_in_kernel=True, **kw)

    def fla_contig(self, i: int):
        """fla-core's kernel alone: set ``i``'s source slots are one contiguous pool block."""
        j = i % self.n_act
        q, k, v, g, beta = self.fla_in[j]
        lo = i * self.block
        return self.peer.fn(q=q, k=k, v=v, g=g, beta=beta, scale=self.scale,
                            initial_state=self.pool[lo : lo + self.B], output_final_state=True,
                            use_qk_l2norm_in_kernel=True)

    def peer_rel_err(self) -> float:
        """Relative error of the peer's output against verify's, from the same states."""
        self.verify(0)
        ours = self.out[0].float()
        theirs = self.fla(0)[0].reshape(ours.shape).float()
        return ((theirs - ours).norm() / ours.norm()).item()

    def calls(self) -> dict:
        calls = {
            "verify": self.verify,
            "commit_nW": lambda i: self.commit(i, self.n_all),
            "commit_n1": lambda i: self.commit(i, self.n_one),
            "snapshot": self.snapshot,
            "folded": self.folded,
            "closed_form_verify": self.closed_form_verify,
            "closed_form_folded": lambda i: self.lazy_verify(i, "closed_form_folded", self.n_all),
        }
        if triton is not None and (self.pool.device.type == "cuda" or _interpreting()):
            calls["native_engine"] = self.native_engine
        if self.peer is not None:
            calls["fla"] = self.fla
            if self.peer.mode == "gather":
                calls["fla_contig"] = self.fla_contig
        return calls


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median time of one call, in microseconds.

    CUDA: ``triton.testing.do_bench(..., return_mode="median")`` (which also flushes L2 before
    each timed call), either on a CUDA graph of up to ``graph_calls`` calls over distinct index
    sets (``mode="graph"``; time / calls) or on single eager calls rotating over every index
    set (``mode="eager"``). CPU: ``time.perf_counter``, median of ``cpu_reps`` calls.
    """

    def __init__(self, device: torch.device, mode: str, warmup_ms: int, rep_ms: int,
                 graph_calls: int, cpu_reps: int):
        self.device, self.mode = device, mode
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.graph_calls, self.cpu_reps = graph_calls, cpu_reps

    def time_fn(self, fn) -> float:
        """Median microseconds of ``fn()`` (no rotation: used for the copy and the FMAs)."""
        if self.device.type != "cuda":
            fn()
            times = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e6
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") * 1e3

    def time_call(self, call, n_sets: int) -> tuple[float, str]:
        """Median microseconds of ``call(i)`` over rotating index sets, and how it was timed."""
        if self.device.type == "cuda" and self.mode == "graph":
            try:
                return self._graph(call, n_sets), "cuda-graph"
            except Exception as exc:  # keep the run going on an unexpected capture failure
                torch.cuda.synchronize()
                print(f"warning: CUDA graph capture failed ({exc!r}); timing eagerly",
                      file=sys.stderr)
        counter = itertools.count()
        us = self.time_fn(lambda: call(next(counter) % n_sets))
        return us, ("eager" if self.device.type == "cuda" else "perf_counter")

    def _graph(self, call, n_sets: int) -> float:
        n = max(1, min(n_sets, self.graph_calls))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile) outside the capture
            for i in range(n):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                call(i)
        us = self.time_fn(graph.replay) / n
        del graph
        return us


def copy_bandwidth(timer: Timer, nbytes: int, device: torch.device) -> dict:
    """Device-to-device ``dst.copy_(src)`` of ``nbytes``; bytes moved = read + write."""
    n = nbytes // 4
    src = torch.randn(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = timer.time_fn(lambda: dst.copy_(src))
    moved = 2 * src.nbytes
    return {"bytes": moved, "time_us": us, "gbps": moved / us / 1e3}


if triton is not None:
    @triton.jit
    def fma_kernel(x_ptr, y_ptr, n, a, b, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        """``FMA_CHAINS`` independent chains of ``ITERS`` fp32 FMAs per element (runtime ``a``,
        ``b``: nothing folds); one load and one store per element."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x0 = tl.load(x_ptr + offs, mask=m, other=0.0)
        x1 = x0 + 1.0
        x2 = x0 + 2.0
        x3 = x0 + 3.0
        for _ in range(ITERS):
            x0 = tl.fma(x0, a, b)
            x1 = tl.fma(x1, a, b)
            x2 = tl.fma(x2, a, b)
            x3 = tl.fma(x3, a, b)
        tl.store(y_ptr + offs, (x0 + x1) + (x2 + x3), mask=m)


def fma_rate(timer: Timer, nbytes: int, iters: int, device: torch.device) -> dict:
    """The fp32 arithmetic ceiling: ops/s of a plain FMA kernel on ``nbytes`` of fp32 data.
    CUDA: :func:`fma_kernel` (Triton); CPU: ``iters`` in-place ``torch.addcmul`` passes on one
    thread."""
    n = max(1, nbytes // 4)
    x = torch.rand(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    if device.type == "cuda":
        block = 1024
        grid = (triton.cdiv(n, block),)

        def fn():
            fma_kernel[grid](x, y, n, 0.999, 0.001, ITERS=iters, BLOCK=block, num_warps=4)

        ops, impl = n * iters * FMA_CHAINS, f"triton, {FMA_CHAINS} chains"
    else:  # one thread: a smoke-test number, free of thread-pool wake-up costs
        a, b = torch.full_like(x, 0.999), torch.full_like(x, 0.001)

        def fn():
            torch.addcmul(b, x, a, out=y)
            for _ in range(iters - 1):
                torch.addcmul(b, y, a, out=y)

        ops, impl = n * iters, "torch.addcmul, 1 thread"
    threads = torch.get_num_threads()
    if device.type != "cuda":
        torch.set_num_threads(1)
    try:
        us = timer.time_fn(fn)
    finally:
        torch.set_num_threads(threads)
    tops = ops / us / 1e6
    return {"elements": n, "iters": iters, "impl": impl, "ops": ops, "time_us": us,
            "tops": tops, "tflops": 2 * tops}


def kernel_stats(us: float, nbytes: int, ops: int, copy: dict, fma: dict, how: str) -> dict:
    """One kernel's entry: time, bytes, ops, bandwidth fraction and roofline fraction."""
    gbps = nbytes / us / 1e3
    mem_us = nbytes / (copy["gbps"] * 1e3)
    ops_us = ops / (fma["tops"] * 1e6)
    floor = max(mem_us, ops_us)
    return {"time_us": us, "bytes": nbytes, "gbps": gbps, "frac_copy_bw": gbps / copy["gbps"],
            "ops": ops, "floor_mem_us": mem_us, "floor_ops_us": ops_us, "floor_us": floor,
            "frac_roofline": floor / us, "bound": "memory" if mem_us >= ops_us else "compute",
            "timing": how}


# ----------------------------------------------------------------------------- run


def tile_config(shape: Shape, kernel: str = "verify", batch: int | None = None):
    try:
        from ssm_spec.ops.gdn.inner import gdn_tile_config
    except ImportError:
        return None
    return list(gdn_tile_config(shape.K, shape.V, kernel, shape.state_dtype, batch))


def check_peer(work: BatchWorkload, peer: Peer, note: str) -> tuple[Peer | None, str, float | None]:
    """Call the peer once (and compare its output with verify's); on failure fall back from
    ``indexed`` to ``gather`` mode, then give up on the peer, with a printed note."""
    while True:
        try:
            err = work.peer_rel_err()
            if work.pool.device.type == "cuda":
                torch.cuda.synchronize()
            return peer, note, err
        except Exception as exc:
            if work.pool.device.type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception:  # a sticky CUDA error: the next op reports it
                    pass
            if peer.mode == "indexed":
                note = f"{note}; the indexed call failed ({type(exc).__name__}: {exc}): gathering"
                peer.mode = "gather"
            else:
                note = f"{note}; the call failed ({type(exc).__name__}: {exc}): peer skipped"
                print(f"note: {note}", file=sys.stderr)
                work.peer = None
                return None, note, None


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    shapes = [Shape(args.heads, args.value_heads, args.head_k, args.head_v, k + 1,
                    DTYPES[args.state_dtype], DTYPES[args.act_dtype]) for k in args.k]
    shape0 = shapes[0]
    timer = Timer(device, args.timing, args.warmup_ms, args.rep_ms, args.graph_calls,
                  args.cpu_reps)

    copy = copy_bandwidth(timer, int(args.copy_gib * GIB), device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fma = fma_rate(timer, int(args.fma_mib * 2**20), args.fma_iters, device)
    peer, peer_note = load_peer(device, not args.no_peer)
    print(f"note: {peer_note}")

    # The pool: >= pool_gib, and >= min_sets disjoint index sets of the largest batch at the
    # largest window.
    max_b, max_w = max(args.batches), max(s.W for s in shapes)
    num_slots = max(math.ceil(args.pool_gib * GIB / shape0.slot_bytes),
                    args.min_sets * max_b * (max_w + 1))
    pool = torch.randn(num_slots, shape0.HV, shape0.K, shape0.V, dtype=shape0.state_dtype,
                       device=device)

    rows = []
    for k, shape in zip(args.k, shapes):
        W = shape.W
        for B in args.batches:
            n_sets = num_slots // (B * (W + 1))
            work = BatchWorkload(shape, pool, B, n_sets, n_act=min(n_sets, args.act_copies),
                                 peer=peer)
            peer_err = None
            if peer is not None:
                peer, peer_note, peer_err = check_peer(work, peer, peer_note)
            moved = shape.bytes_moved(B, peer.mode if peer is not None else None)
            ops = shape.ops(B)
            kernels = {}
            for name, call in work.calls().items():
                us, how = timer.time_call(call, n_sets)
                kernels[name] = kernel_stats(us, moved[name], ops[name], copy, fma, how)
            phase_us = {p: timer.time_call(call, n_sets)[0] for p, call in work.lazy_calls().items()}
            kernels["lazy"] = kernel_stats(statistics.mean(phase_us.values()), moved["lazy"], ops["lazy"], copy, fma,
                                           how)
            kernels["lazy"]["phase_us"] = {str(p): us for p, us in phase_us.items()}
            t = {name: kernels[name]["time_us"] for name in kernels}
            snap = t["snapshot"]
            row = {
                "k": k,
                "W": W,
                "batch": B,
                "tokens": B * W,
                "index_sets": n_sets,
                "kernels": kernels,
                "verify+commit_nW_us": t["verify"] + t["commit_nW"],
                "verify+commit_n1_us": t["verify"] + t["commit_n1"],
                "snapshot_us": snap,
                "ratio_vcW_over_snapshot": (t["verify"] + t["commit_nW"]) / snap,
                "ratio_vc1_over_snapshot": (t["verify"] + t["commit_n1"]) / snap,
                "ratio_folded_over_snapshot": t["folded"] / snap,
                "ratio_folded_over_vcW": t["folded"] / (t["verify"] + t["commit_nW"]),
                "native_engine_us": t.get("native_engine"),
                "ratio_vcW_over_native_engine": ((t["verify"] + t["commit_nW"]) / t["native_engine"]
                                                 if "native_engine" in t else None),
                "ratio_folded_over_native_engine": (t["folded"] / t["native_engine"]
                                                    if "native_engine" in t else None),
                "ratio_closed_form_vcW_over_snapshot": (t["closed_form_verify"] + t["commit_nW"]) / snap,
                "ratio_closed_form_folded_over_snapshot": t["closed_form_folded"] / snap,
                "ratio_lazy_over_snapshot": t["lazy"] / snap,
                "ratio_lazy_over_native_engine": t["lazy"] / t["native_engine"] if "native_engine" in t else None,
                "ratio_closed_form_verify_over_verify": t["closed_form_verify"] / t["verify"],
                "bytes_ratio_vcW_over_snapshot":
                    (moved["verify"] + moved["commit_nW"]) / moved["snapshot"],
                "bytes_ratio_vc1_over_snapshot":
                    (moved["verify"] + moved["commit_n1"]) / moved["snapshot"],
                "bytes_ratio_folded_over_snapshot": moved["folded"] / moved["snapshot"],
            }
            if "fla" in t:
                row["ratio_fla_over_snapshot"] = t["fla"] / snap
                row["ratio_folded_over_fla"] = t["folded"] / t["fla"]
                row["fla_rel_err_vs_verify"] = peer_err
            rows.append(row)
            del work
            if device.type == "cuda":
                torch.cuda.synchronize()

    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", None),
        "cuda": torch.version.cuda,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "sm_count": getattr(props, "multi_processor_count", None),
        "timing": args.timing if device.type == "cuda" else "perf_counter",
        "config": {
            "k": list(args.k), "W": [s.W for s in shapes], "batches": list(args.batches),
            "H": shape0.H, "HV": shape0.HV, "K": shape0.K, "V": shape0.V,
            "state_dtype": args.state_dtype, "act_dtype": args.act_dtype,
            "tiles_BK_BV_warps": {kernel: {B: tile_config(shape0, kernel, B) for B in args.batches}
                                  for kernel in ("verify", "snapshot", "commit", "closed_form")},
            "lazy_max_pending": LAZY_MAX_PENDING,
            "pool_slots": num_slots, "slot_bytes": shape0.slot_bytes,
            "pool_bytes": num_slots * shape0.slot_bytes,
            "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "graph_calls": args.graph_calls, "act_copies": args.act_copies,
            "fma_mib": args.fma_mib, "fma_iters": args.fma_iters,
        },
        "copy_bandwidth_gbps": copy["gbps"],
        "copy": copy,
        "fma_tops": fma["tops"],
        "fma": fma,
        "record_bytes_per_token": shape0.record_bytes_per_token,
        "record_bytes_per_token_over_state":
            shape0.record_bytes_per_token / (shape0.HV * shape0.K * shape0.V * 4),
        "ring_bytes_per_slot_over_state": ring_memory(shape0, max(s.W for s in shapes)),
        "peer": {"name": "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
                 "available": peer is not None, "mode": getattr(peer, "mode", None),
                 "fla_core_version": getattr(peer, "version", None), "note": peer_note},
        "bytes_model": BYTES_MODEL,
        "ops_model": OPS_MODEL,
        "rows": rows,
    }


# ----------------------------------------------------------------------------- output


SHORT = {"verify": ("verify", "ver"), "commit_nW": ("commit_W", "cW"),
         "commit_n1": ("commit_1", "c1"), "snapshot": ("snapshot", "snap"),
         "folded": ("folded", "fold"), "fla": ("fla", "fla"), "fla_contig": ("fla_cont", "flac"),
         "native_engine": ("engine", "eng"), "closed_form_verify": ("cf_verify", "cfv"),
         "closed_form_folded": ("cf_folded", "cff"), "lazy": ("lazy", "lazy")}


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"{res['device']}  torch {res['torch']}  triton {res['triton']}  timing {res['timing']}")
    print(f"H={c['H']} HV={c['HV']} K={c['K']} V={c['V']} k={','.join(map(str, c['k']))} "
          f"state={c['state_dtype']} act={c['act_dtype']}  slot={c['slot_bytes'] / 2**20:.3g} MiB  "
          f"pool={c['pool_bytes'] / GIB:.3g} GiB")
    print(f"copy bandwidth: {res['copy_bandwidth_gbps']:.1f} GB/s "
          f"({res['copy']['bytes'] / GIB:.3g} GiB moved in {res['copy']['time_us']:.1f} us)")
    f = res["fma"]
    print(f"fp32 FMA rate: {f['tops']:.3g} Tops/s = {f['tflops']:.3g} TFLOP/s "
          f"({f['impl']}: {f['elements']} elements x {f['iters']} iters in {f['time_us']:.1f} us)")
    print(f"record per token / fp32 state slot: {100 * res['record_bytes_per_token_over_state']:.2f}%"
          f"  (target < 1.5%)")
    print(f"peer: {res['peer']['note']}")
    print("times: median us per call; %roof: floor / time with floor = max(bytes / copy bw, "
          "ops / FMA rate), m|c: memory or compute sets the floor; ratios in time")
    names = [n for n in (*KERNELS, *PEER_KERNELS) if any(n in r["kernels"] for r in res["rows"])]
    head = (f"{'B':>5} | " + " ".join(f"{SHORT[n][0]:>9}" for n in names)
            + " | %roof " + " ".join(f"{SHORT[n][1]:>4}" for n in names)
            + f" | {'(v+cW)/s':>8} {'(v+c1)/s':>8} {'fold/s':>7} {'fold/(v+cW)':>11}"
            + f" {'(v+cW)/eng':>10} {'fold/eng':>8}")
    for kv in c["k"]:
        rows = [r for r in res["rows"] if r["k"] == kv]
        r0 = rows[0]
        print(f"\nk={kv} (W={r0['W']})  bytes ratios (same for every B): "
              f"(v+cW)/snapshot {r0['bytes_ratio_vcW_over_snapshot']:.3f}, "
              f"(v+c1)/snapshot {r0['bytes_ratio_vc1_over_snapshot']:.3f}, "
              f"folded/snapshot {r0['bytes_ratio_folded_over_snapshot']:.3f}")
        print(head)
        print("-" * len(head))
        for r in rows:
            ks = r["kernels"]
            times = " ".join(f"{ks[n]['time_us']:9.2f}" if n in ks else f"{'-':>9}" for n in names)
            roof = " ".join(f"{100 * ks[n]['frac_roofline']:3.0f}{ks[n]['bound'][0]}" if n in ks
                            else f"{'-':>4}" for n in names)
            print(f"{r['batch']:>5} | {times} |       {roof} "
                  f"| {r['ratio_vcW_over_snapshot']:8.3f} {r['ratio_vc1_over_snapshot']:8.3f} "
                  f"{r['ratio_folded_over_snapshot']:7.3f} {r['ratio_folded_over_vcW']:11.3f} "
                  f"{_ratio(r['ratio_vcW_over_native_engine']):>10} {_ratio(r['ratio_folded_over_native_engine']):>8}")
        if any("lazy" in r["kernels"] for r in rows):
            print(f"fast mode (k={kv}): {'B':>5} | {'cfv %copy':>9} {'cfv/ver':>7} | {'(cfv+cW)/s':>10} "
                  f"{'cff/s':>6} {'lazy/s':>6} {'lazy/eng':>8}")
            for r in rows:
                cfv = r["kernels"]["closed_form_verify"]
                print(f"{'':>19}{r['batch']:>5} | {100 * cfv['frac_copy_bw']:8.0f}% "
                      f"{r['ratio_closed_form_verify_over_verify']:7.3f} | "
                      f"{r['ratio_closed_form_vcW_over_snapshot']:10.3f} "
                      f"{r['ratio_closed_form_folded_over_snapshot']:6.3f} {r['ratio_lazy_over_snapshot']:6.3f} "
                      f"{_ratio(r['ratio_lazy_over_native_engine']):>8}")
    if "ring_bytes_per_slot_over_state" in res:
        print("lazy record ring per slot / fp32 state: " + ", ".join(
            f"L={L}: {100 * f['pending']:.1f}% pending ({100 * f['ring']:.1f}% with the window's positions)"
            for L, f in res["ring_bytes_per_slot_over_state"].items()))


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


#: The ratio panels of the plot: (top row key, bottom row key, the baseline's name).
RATIO_PANELS = (("ratio_vcW_over_snapshot", "ratio_folded_over_snapshot", "snapshot"),
                ("ratio_vcW_over_native_engine", "ratio_folded_over_native_engine", "engine kernel"),
                ("ratio_closed_form_folded_over_snapshot", "ratio_lazy_over_snapshot", "snapshot"))
RATIO_TITLES = {"ratio_vcW_over_snapshot": "(verify + commit n=W)", "ratio_folded_over_snapshot": "folded",
                "ratio_vcW_over_native_engine": "(verify + commit n=W)", "ratio_folded_over_native_engine": "folded",
                "ratio_closed_form_folded_over_snapshot": "fast folded", "ratio_lazy_over_snapshot": "lazy"}


def save_plot(res: dict, path: Path) -> bool:
    """One column per kernel: median time (top) and roofline fraction (bottom) vs batch, one
    colour per k; the last column holds the ratios (v + commit n=W) / snapshot and
    folded / snapshot."""
    plt = pyplot()
    if plt is None:
        return False
    rows, c = res["rows"], res["config"]
    names = [n for n in (*KERNELS, *PEER_KERNELS) if any(n in r["kernels"] for r in rows)]
    ks = c["k"]
    colours = {k: plt.cm.viridis(i / max(1, len(ks) - 1) * 0.9) for i, k in enumerate(ks)}
    ncols = 4
    groups = -(-(len(names) + len(RATIO_PANELS)) // ncols)
    fig, axes = plt.subplots(2 * groups, ncols, figsize=(4 * ncols, 5.6 * groups), squeeze=False)
    times = [r["kernels"][n]["time_us"] for r in rows for n in names if n in r["kernels"]]
    t_lim = (min(times) / 1.5, max(times) * 1.5)
    f_max = max(1.05, max(r["kernels"][n]["frac_roofline"] for r in rows for n in names
                          if n in r["kernels"]) * 1.05)

    def series(k, name=None, key=None):
        """(batches, values) of k's rows: ``r["kernels"][name][key]``, or ``r[key]``."""
        sel = [r for r in rows if r["k"] == k and (name is None or name in r["kernels"])]
        return ([r["batch"] for r in sel],
                [r["kernels"][name][key] if name is not None else r[key] for r in sel])

    for idx in range(groups * ncols):
        ax_t, ax_f = axes[2 * (idx // ncols), idx % ncols], axes[2 * (idx // ncols) + 1, idx % ncols]
        if idx < len(names):
            name = names[idx]
            for k in ks:
                ax_t.plot(*series(k, name, "time_us"), marker="o", ms=3, color=colours[k],
                          label=f"k={k}")
                ax_f.plot(*series(k, name, "frac_roofline"), marker="o", ms=3, color=colours[k],
                          label=f"k={k}")
            ax_t.set(yscale="log", ylim=t_lim, title=LABELS[name], ylabel="median time (us)")
            ax_f.set(ylim=(0, f_max), ylabel="fraction of roofline floor")
        elif idx < len(names) + len(RATIO_PANELS) and any(r.get(RATIO_PANELS[idx - len(names)][0]) for r in rows):
            base = RATIO_PANELS[idx - len(names)]
            for ax, key in ((ax_t, base[0]), (ax_f, base[1])):
                for k in ks:
                    ax.plot(*series(k, key=key), marker="o", ms=3, color=colours[k], label=f"k={k}")
                ax.set(title=f"{RATIO_TITLES[key]} / {base[2]}", ylabel="time ratio")
                ax.axhline(1.0, color="grey", lw=0.8)
        else:
            ax_t.axis("off")
            ax_f.axis("off")
            continue
        for ax in (ax_t, ax_f):
            bs = sorted({r["batch"] for r in rows})
            ax.set_xscale("log")
            ax.set_xticks(bs, [str(b) for b in bs], fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
        ax_f.set_xlabel("batch (rows)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(ks), fontsize=9)
    fig.suptitle(f"{res['device']}: GDN ops per layer and step, HV={c['HV']} K={c['K']} V={c['V']}, "
                 f"{c['state_dtype']} state; copy {res['copy_bandwidth_gbps']:.0f} GB/s, "
                 f"FMA {res['fma']['tflops']:.3g} TFLOP/s", x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--replot", metavar="RESULT.json", default=None,
                   help="redraw the table and plot of a saved run (no device needed; other options ignored)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (smoke test only)")
    p.add_argument("--batches", type=ints, default=None,
                   help="comma-separated batch sizes (default 1,4,16,32,64,128,256; cpu: 1,2)")
    p.add_argument("--k", type=ints, default=None,
                   help="comma-separated draft lengths; window W = k + 1 (default 1,2,3,5,7; "
                        "cpu: 1,3)")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the state pool")
    p.add_argument("--act-dtype", choices=list(DTYPES), default="bfloat16",
                   help="dtype of q, k, v, beta and out")
    p.add_argument("--heads", type=int, default=16, help="key heads H")
    p.add_argument("--value-heads", type=int, default=32, help="value heads HV")
    p.add_argument("--head-k", type=int, default=None, help="key head dim K (default 128; cpu: 16)")
    p.add_argument("--head-v", type=int, default=None, help="value head dim V (default 128; cpu: 16)")
    add_out_args(p)
    p.add_argument("--timing", choices=["graph", "eager"], default="graph",
                   help="cuda: time a CUDA graph of several calls, or single eager calls")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warmup")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time")
    p.add_argument("--graph-calls", type=int, default=16,
                   help="calls (distinct index sets) per captured graph")
    p.add_argument("--act-copies", type=int, default=16,
                   help="copies of the activations, outputs and records rotated over")
    p.add_argument("--pool-gib", type=float, default=None,
                   help="minimum state pool size in GiB (default 2; cpu: 0.004)")
    p.add_argument("--min-sets", type=int, default=3,
                   help="disjoint index sets of the largest batch the pool must hold")
    p.add_argument("--copy-gib", type=float, default=None,
                   help="copy buffer size in GiB (default 1; cpu: 0.0625)")
    p.add_argument("--fma-mib", type=float, default=None,
                   help="fp32 data of the FMA kernel in MiB (default 64; cpu: 1)")
    p.add_argument("--fma-iters", type=int, default=None,
                   help="FMAs per element and chain in the FMA kernel (default 512; cpu: 32)")
    p.add_argument("--no-peer", action="store_true", help="skip the fla-core peer")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions on cpu")
    args = p.parse_args(argv)

    cpu = torch.device(args.device).type == "cpu"
    defaults = {
        "batches": [1, 2] if cpu else [1, 4, 16, 32, 64, 128, 256],
        "k": [1, 3] if cpu else [1, 2, 3, 5, 7],
        "head_k": 16 if cpu else 128,
        "head_v": 16 if cpu else 128,
        "pool_gib": 0.004 if cpu else 2.0,
        "copy_gib": 0.0625 if cpu else 1.0,
        "fma_mib": 1.0 if cpu else 64.0,
        "fma_iters": 32 if cpu else 512,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.batches or min(args.batches) < 1:
        p.error("--batches: expected positive integers")
    if not args.k or min(args.k) < 0:
        p.error("--k: expected non-negative integers")
    if args.fma_iters < 1 or args.fma_mib <= 0:
        p.error("--fma-iters and --fma-mib must be positive")
    if args.value_heads % args.heads:
        p.error("--value-heads must be a multiple of --heads")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for a smoke test)")
    resolve_out_dir(p, args, smoke=cpu)
    return args


def main(argv=None) -> dict:
    if argv is None:
        argv = sys.argv[1:]
    if "--replot" in argv:  # redraw a saved run: --replot RESULT.json (no device needed)
        i = argv.index("--replot")
        if i + 1 >= len(argv):
            raise SystemExit("usage: bench_ops.py --replot RESULT.json")
        path = Path(argv[i + 1])
        res = json.loads(path.read_text())
        print_table(res)
        save_plot(res, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
        return res
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    write_results(res, args.out_dir, f"bench_ops_{slug(res['device'])}_{args.state_dtype}", save_plot)
    return res


if __name__ == "__main__":
    main()
