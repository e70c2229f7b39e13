"""The outside implementation ``bench_ops.py`` times against: fla-core's
``fused_recurrent_gated_delta_rule`` (imported lazily, CUDA only), how the installed version is
called, and its calls over a :class:`ops_workloads.BatchWorkload`'s rows and window."""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
from dataclasses import dataclass

import torch
from ops_workloads import BatchWorkload

PEER_KERNELS = ("fla", "fla_contig")


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


class PeerCalls:
    """The peer over ``work``'s rows and window, from the same states. Its inputs are contiguous
    ``[B, W, ...]`` copies of the workload's activations (fla's kernel assumes contiguous q, k,
    v; handing it the strided views would time a copy)."""

    def __init__(self, work: BatchWorkload, peer: Peer):
        self.work, self.peer = work, peer
        B, W = work.B, work.W
        self.fla_in = [(q.contiguous().view(B, W, *q.shape[1:]), k.contiguous().view(B, W, *k.shape[1:]),
                        v.contiguous().view(B, W, *v.shape[1:]), g.view(B, W, -1), beta.view(B, W, -1))
                       for q, k, v, g, beta in work.window]
        self.fla_flat = [tuple(x.flatten(0, 1).unsqueeze(0) for x in w) for w in self.fla_in]
        self.qsl_long = work.qsl.to(torch.int64)

    def fla(self, i: int):
        """fla-core over the same rows and window; states by index (see :class:`Peer`)."""
        work, peer = self.work, self.peer
        j = i % work.n_act
        if peer.mode == "indexed":
            q, k, v, g, beta = self.fla_flat[j]  # [1, T, ...] with cu_seqlens
            kw = dict(initial_state=work.pool, ssm_state_indices=work.src[i],
                      cu_seqlens=self.qsl_long)
            if "inplace_final_state" in peer.params:
                kw["inplace_final_state"] = True
            else:
                kw["output_final_state"] = True
        else:
            q, k, v, g, beta = self.fla_in[j]  # [B, W, ...]
            kw = dict(initial_state=work.pool.index_select(0, work.src[i]),
                      output_final_state=True)
        return peer.fn(q=q, k=k, v=v, g=g, beta=beta, scale=work.scale,
                       use_qk_l2norm_in_kernel=True, **kw)

    def fla_contig(self, i: int):
        """fla-core's kernel alone: set ``i``'s source slots are one contiguous pool block."""
        work = self.work
        q, k, v, g, beta = self.fla_in[i % work.n_act]
        lo = i * work.block
        return self.peer.fn(q=q, k=k, v=v, g=g, beta=beta, scale=work.scale,
                            initial_state=work.pool[lo : lo + work.B], output_final_state=True,
                            use_qk_l2norm_in_kernel=True)

    def rel_err(self) -> float:
        """Relative error of the peer's output against verify's, from the same states."""
        self.work.verify(0)
        ours = self.work.out[0].float()
        theirs = self.fla(0)[0].reshape(ours.shape).float()
        return ((theirs - ours).norm() / ours.norm()).item()

    def calls(self) -> dict:
        """``fla``, and ``fla_contig`` where the states are gathered (the indexed call reads the
        pool in place: no gather to leave out)."""
        calls = {"fla": self.fla}
        if self.peer.mode == "gather":
            calls["fla_contig"] = self.fla_contig
        return calls


def check_peer(calls: PeerCalls, note: str) -> tuple[Peer | None, str, float | None]:
    """Call the peer once (and compare its output with verify's); on failure fall back from
    ``indexed`` to ``gather`` mode, then give up on the peer, with a printed note."""
    peer, cuda = calls.peer, calls.work.pool.device.type == "cuda"
    while True:
        try:
            err = calls.rel_err()
            if cuda:
                torch.cuda.synchronize()
            return peer, note, err
        except Exception as exc:
            if cuda:
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
                return None, note, None
