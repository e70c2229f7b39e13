"""``StatePool``: every layer's recurrent and conv states, and the replay record buffers.

States are stacked per shape group with a leading layer dim, so one grouped commit launch
covers every GDN layer of a group and one covers every conv layer of a shape (DESIGN.md
section 5). The record buffers ``[NL, max_tokens, ...]`` live outside the state pages: a
record lives only from a step's verify to its commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ops import NULL_SLOT, ReplayRecord

__all__ = ["StatePool", "GDNStateSpec", "ConvStateSpec", "NULL_SLOT"]


@dataclass(frozen=True)
class GDNStateSpec:
    """A GDN recurrent state: ``HV`` value heads of ``[K, V]``; ``H`` key heads."""

    num_v_heads: int
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int


@dataclass(frozen=True)
class ConvStateSpec:
    """A short-conv state: the last ``state_len = (kernel_size - 1) * dilation`` inputs of
    ``channels`` channels."""

    state_len: int
    channels: int


@dataclass
class _Group:
    spec: object
    members: list = field(default_factory=list)
    state: torch.Tensor | None = None
    records: tuple | None = None


class StatePool:
    """Stacked states of every registered layer, fp32 or bf16, and fp32 record buffers.

    Layers register the states they need (``RecoverGatedDeltaNet``: one GDN state and one conv
    state; ``RecoverShortConv``: one conv state); layers with equal shapes share a group, one
    tensor with a leading layer dim.

    Args:
        layers: modules with a ``state_specs()`` method (the ssm_spec modules), in order.
        num_slots: slots per layer (one per request; align mode: one per block).
        max_tokens: the most tokens one step's verify windows span (sizes the record buffers;
            prefill tokens outside that span need no record).
        dtype: recurrent state dtype, ``torch.float32`` or ``torch.bfloat16``.
        conv_dtype: conv state dtype (default ``dtype``).
        device: where every tensor lives.
        snapshot: the native protocol instead of RecoverSSM (the one switch that lets tests
            and benchmarks compare both on one model): verify writes the state after every
            window token into a per-token scratch slot (``num_slots + t``, plus one dummy
            slot), and :func:`ssm_spec.commit` copies the accepted one back.

    Attributes:
        gdn_state(layer) / conv_state(layer): views ``[S, ...]`` of one layer's states.
        gdn_groups / conv_groups: ``{spec: (state [NL, S, ...], records)}``.

    Raises:
        ValueError: on a non-positive slot or token count, or an unsupported dtype; the
            per-layer accessors raise it for a layer the pool does not hold.
    """

    def __init__(self, layers, num_slots: int, max_tokens: int, *, dtype=torch.float32,
                 conv_dtype=None, device=None, snapshot: bool = False):
        if num_slots < 1 or max_tokens < 1:
            raise ValueError(f"StatePool: num_slots={num_slots}, max_tokens={max_tokens}; expected >= 1")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"StatePool: dtype: got {dtype}; expected torch.float32 or torch.bfloat16")
        if conv_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"StatePool: conv_dtype: got {conv_dtype}; expected float32, bfloat16 or float16")
        self.num_slots = int(num_slots)
        self.max_tokens = int(max_tokens)
        self.snapshot = bool(snapshot)
        self.dtype = dtype
        self.conv_dtype = conv_dtype or dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._gdn: dict[GDNStateSpec, _Group] = {}
        self._conv: dict[ConvStateSpec, _Group] = {}
        self._where: dict[int, dict[str, tuple]] = {}
        for layer in layers:
            for kind, spec in layer.state_specs():
                groups = self._gdn if kind == "gdn" else self._conv
                group = groups.setdefault(spec, _Group(spec))
                self._where.setdefault(id(layer), {})[kind] = (spec, len(group.members))
                group.members.append(layer)
        T, dev = self.max_tokens, self.device
        S = self.num_slots + (T + 1 if self.snapshot else 0)  # scratch slots and one dummy
        self._token_slots = torch.arange(self.num_slots, self.num_slots + T, dtype=torch.int32, device=dev)
        for spec, group in self._gdn.items():
            nl, hv, h, k, v = len(group.members), spec.num_v_heads, spec.num_k_heads, spec.head_k_dim, spec.head_v_dim
            group.state = torch.zeros((nl, S, hv, k, v), dtype=dtype, device=dev)
            group.records = ReplayRecord(torch.zeros((nl, T, hv, v), device=dev),
                                         torch.zeros((nl, T, h, k), device=dev),
                                         torch.zeros((nl, T, hv), device=dev))
        for spec, group in self._conv.items():
            nl = len(group.members)
            group.state = torch.zeros((nl, S, spec.state_len, spec.channels), dtype=self.conv_dtype, device=dev)
            group.records = torch.zeros((nl, T, spec.channels), device=dev)

    # ------------------------------------------------------------------ lookup
    def _locate(self, layer, kind):
        try:
            spec, index = self._where[id(layer)][kind]
        except KeyError:
            raise ValueError(f"StatePool: the layer {type(layer).__name__} has no {kind} state in this pool") from None
        return (self._gdn if kind == "gdn" else self._conv)[spec], index

    def gdn_state(self, layer) -> torch.Tensor:
        """``[S, HV, K, V]`` view of ``layer``'s recurrent states."""
        group, i = self._locate(layer, "gdn")
        return group.state[i]

    def gdn_record(self, layer, num_tokens: int) -> ReplayRecord:
        """Views ``[num_tokens, ...]`` of ``layer``'s record buffers."""
        group, i = self._locate(layer, "gdn")
        return ReplayRecord(*(r[i, :num_tokens] for r in group.records))

    def conv_state(self, layer) -> torch.Tensor:
        """``[S, Lc, C]`` view of ``layer``'s conv states."""
        group, i = self._locate(layer, "conv")
        return group.state[i]

    def conv_record(self, layer, num_tokens: int) -> torch.Tensor:
        """``[num_tokens, C]`` view of ``layer``'s recorded conv inputs."""
        group, i = self._locate(layer, "conv")
        return group.records[i, :num_tokens]

    def snapshot_slots(self, num_tokens: int) -> torch.Tensor:
        """Snapshot mode: ``[num_tokens]`` int32, the scratch slot of each token (a view)."""
        return self._token_slots[:num_tokens]

    @property
    def dummy_slot(self) -> int:
        """Snapshot mode: a scratch slot no token uses (a harmless copy target)."""
        return self.num_slots + self.max_tokens

    @property
    def gdn_groups(self):
        return {spec: (g.state, g.records) for spec, g in self._gdn.items()}

    @property
    def conv_groups(self):
        return {spec: (g.state, g.records) for spec, g in self._conv.items()}

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Zero the given slots of every state (a fresh request starts from the zero state).

        Args:
            slots: int tensor of distinct valid slots on the pool's device (the metadata's
                ``fresh_slots``); no host sync.
        """
        if slots.numel() == 0:
            return
        index = slots.to(device=self.device, dtype=torch.long)
        for group in (*self._gdn.values(), *self._conv.values()):
            group.state.index_fill_(1, index, 0)
