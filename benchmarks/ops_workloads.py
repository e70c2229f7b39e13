"""The workload ``bench_ops.py`` times: the layer shape, and for one batch size the pool's slot
sets, the activations, outputs and records, and one call per op (``torch.ops.ssm_spec.*`` with
preallocated buffers, so no allocation or host-side value validation is timed)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import ssm_spec  # noqa: F401  (registers torch.ops.ssm_spec.*)

try:
    import triton
except ImportError:  # no Triton: the CPU smoke test still runs (without the engines' kernel)
    triton = None

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNELS = ("verify", "commit_nW", "commit_n1", "snapshot", "native_engine", "folded", "closed_form_verify",
           "closed_form_folded", "lazy")
#: Fast mode's lazy commit as benchmarked: ``max_pending`` and the accepted tokens per step
#: (``W - 1``: 3 of 4 at k=3); its time is the mean over one fold cycle (:func:`lazy_phases`).
LAZY_MAX_PENDING = 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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


class BatchWorkload:
    """Buffers and the op calls for one batch size.

    Index set ``i`` owns the slot block ``[i * B * (W + 1), (i + 1) * B * (W + 1))`` of the
    pool: its first ``B`` slots are the rows' sources (checkpoints), the next ``T = B * W``
    the snapshot slots of token ``t`` (never any row's source). Activations, outputs and
    records come in ``n_act`` copies; call ``i`` uses set ``i`` and copy ``i % n_act``. The
    folded verify writes record copy ``j`` and replays copy ``j + 1`` (mod ``n_act``; a
    separate copy when ``n_act == 1``) as the previous step's: double-buffered.
    """

    def __init__(self, shape: Shape, pool: torch.Tensor, B: int, n_sets: int, n_act: int):
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
        return calls


def tile_config(shape: Shape, kernel: str = "verify", batch: int | None = None):
    try:
        from ssm_spec.ops.gdn.inner import gdn_tile_config
    except ImportError:
        return None
    return list(gdn_tile_config(shape.K, shape.V, kernel, shape.state_dtype, batch))
