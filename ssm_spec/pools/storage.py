"""``StatePool``: every layer's recurrent and conv states, and the replay record buffers.

States are stacked per ``(device, shape)`` group with a leading layer dim, so one grouped commit
launch covers every GDN layer of a group and one covers every conv layer of a shape on a device
(docs/design.md sections 5.3 and 5.9). The record buffers ``[NL, max_tokens, ...]`` live outside
the state pages: a record lives only from a step's verify to its commit. What the states go
through at verify and commit is the pool's protocol (:mod:`ssm_spec.pools.protocols`); where
they live, :mod:`ssm_spec.pools.placement`; folded pools' pending windows,
:mod:`ssm_spec.pools.pending`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..ops import RecordRing, ReplayRecord, _eager
from ..ops.gdn.closed_form import ring_positions
from .pending import PendingWindows, slot_tensor
from . import placement
from .placement import group_layers, needs_launch_guard, placement_device
from .protocols import make_protocol

__all__ = ["StatePool", "GDNStateSpec", "ConvStateSpec"]


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
    device: torch.device
    members: list = field(default_factory=list)
    state: torch.Tensor | None = None
    records: tuple | None = None
    prev_records: tuple | None = None
    ring: RecordRing | None = None



class StatePool:
    """Stacked states of every registered layer, fp32 or bf16, and fp32 record buffers.

    Layers register the states they need (``RecoverGatedDeltaNet``: one GDN state and one conv
    state; ``RecoverShortConv``: one conv state); layers with equal shapes on one device share a
    group, one tensor with a leading layer dim on that device (:func:`group_layers`). Every
    launch the pool makes or drives (:func:`ssm_spec.commit`, :meth:`zero_slots`, :meth:`flush`,
    the snapshot copies, the folded plans' hand-over) runs once per group, on the group's device;
    on a pool over several devices (or on a GPU that was not current when the pool was made) the
    ssm_spec kernels of a CUDA group, and each layer's step, run with the group's device current
    (:meth:`launch_guard`).

    Args:
        layers: modules with a ``state_specs()`` method (the ssm_spec modules), in order.
        num_slots: slots per layer (one per request; align mode: one per block).
        max_tokens: the most tokens one step's verify windows span (sizes the record buffers;
            prefill tokens outside that span need no record).
        dtype: recurrent state dtype, ``torch.float32`` or ``torch.bfloat16``.
        conv_dtype: conv state dtype (default ``dtype``).
        device: where the states live: one device for every layer (default: the CPU), or a
            sequence of one device per layer (a model spread over devices, e.g. by a
            ``device_map``; each layer's states go to the device its forward runs on). The
            bookkeeping a step shares (folded mode's pending counts, snapshot slots) lives on the
            first layer's device, :attr:`device` (not ``meta``, which holds no values: a
            ``ValueError``): build the step's metadata and the accepted counts there and pass
            the same metadata object to every layer; layers on other devices use copies made
            once per metadata object (:meth:`~ssm_spec.RecoverSSMMetadata.to`). A pool on
            ``meta`` alone allocates and computes nothing (shapes only).
        snapshot: the native protocol instead of RecoverSSM (the one switch that lets tests
            and benchmarks compare both on one model): verify writes the state after every
            window token into a per-token scratch slot (``num_slots + t``, plus one dummy
            slot), and :func:`ssm_spec.commit` copies the accepted one back.
        folded: the folded commit (GDN states): :func:`ssm_spec.commit` only notes each row's
            accepted count, and the next step's verify commits it on the way (one state read
            and one write per step, ``gdn_folded_verify``); the GDN record buffers are
            double-buffered. Every slot with a pending window must be verified by the next
            step or flushed first (:meth:`flush`, e.g. when its request finishes or is
            preempted, or before reading its state); :meth:`discard` drops pending windows.
            Conv states commit immediately as usual. Not with ``snapshot`` or align mode. The
            host-side checks (a step that skips a pending slot, a prefill continuing from one)
            run while every commit validates (the eager default); a commit without validation
            (captured or compiled steps) turns them off.
        mode: ``"exact"`` (default) or ``"fast"`` (docs/design.md section 2.6): the layers verify
            with the closed-form window (``gdn_closed_form_verify``) instead of the token loop:
            faster, not bit-identical (outputs within 4x the exact kernel's error, tested).
            With ``folded=True`` fast mode keeps each slot's accepted tokens as records in a
            per-slot ring (:class:`~ssm_spec.ops.RecordRing`, outside the state pages) and
            writes a state only when they would pass ``max_pending`` (the lazy commit,
            ``gdn_closed_form_folded_verify``); slots keep their pending tokens across steps
            they are not verified in, and a prefill continuing a slot flushes it first.
        max_pending: fast folded mode: the most accepted tokens a slot keeps pending
            (``L``; default 1: the state is written at every step that has something pending,
            the folded commit). ``> 1`` needs ``mode="fast"`` and ``folded=True``.
        max_window: fast folded mode: the longest verify window a step may have (sizes the
            rings: ``max(max_pending, max_window) + max_window`` positions per slot); default
            ``max_tokens``. ``flush`` launches with it, so set it to the window the steps verify
            (``k + 1``) and the flush reuses their compiled kernel; a longer one costs ring memory
            and one more kernel variant.

    Attributes:
        gdn_state(layer) / conv_state(layer): views ``[S, ...]`` of one layer's states.
        gdn_groups / conv_groups: ``{(device, spec): (state [NL, S, ...], records)}``, the
            tensors on ``device``.
        device: the first layer's device (the only one for a pool on one device), as
            :func:`placement_device` names it (``"cuda"`` is ``cuda:<current>``, ``"cpu:0"`` is
            ``cpu``).
        devices: every device holding a group, in order of first appearance.
        spread: ``len(devices) > 1``.
        guarded: whether launches run under :meth:`launch_guard` (:func:`needs_launch_guard`).

    Raises:
        ValueError: on a non-positive slot or token count, or an unsupported dtype; a
            ``device`` sequence that is not one device per layer, or whose first layer is on
            ``meta`` while others are not; the per-layer accessors raise it for a layer the pool
            does not hold.
    """

    def __init__(self, layers, num_slots: int, max_tokens: int, *, dtype=torch.float32,
                 conv_dtype=None, device=None, snapshot: bool = False, folded: bool = False,
                 mode: str = "exact", max_pending: int = 1, max_window: int | None = None):
        if num_slots < 1 or max_tokens < 1:
            raise ValueError(f"StatePool: num_slots={num_slots}, max_tokens={max_tokens}; expected >= 1")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"StatePool: dtype: got {dtype}; expected torch.float32 or torch.bfloat16")
        if conv_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"StatePool: conv_dtype: got {conv_dtype}; expected float32, bfloat16 or float16")
        self.num_slots = int(num_slots)
        self.max_tokens = int(max_tokens)
        #: the state protocol (:mod:`ssm_spec.pools.protocols`): what verify, commit, flush and discard do
        self.protocol = make_protocol(snapshot=bool(snapshot), folded=bool(folded), mode=mode, max_pending=max_pending)
        self.snapshot = self.protocol.snapshot
        self.folded = self.protocol.folded
        self.mode = mode
        self.max_pending = int(max_pending)
        self.max_window = int(max_tokens if max_window is None else max_window)
        if not 1 <= self.max_window <= self.max_tokens:
            raise ValueError(f"StatePool: max_window: got {max_window}; expected 1..max_tokens ({self.max_tokens})")
        #: fast folded mode: records live in per-slot rings (the lazy commit)
        self.ring_mode = self.protocol.ring
        self.ring_positions = ring_positions(self.max_pending, self.max_window) if self.ring_mode else 0
        self.dtype = dtype
        self.conv_dtype = conv_dtype or dtype
        layers = list(layers)
        if device is None or isinstance(device, (str, int, torch.device)):
            one = placement_device("cpu" if device is None else device)
            per_layer = [one] * len(layers)
        else:
            per_layer = list(device)
            one = placement_device(per_layer[0]) if per_layer else torch.device("cpu")
        self._gdn: dict[tuple, _Group] = {}  # (device, GDNStateSpec) -> group
        self._conv: dict[tuple, _Group] = {}  # (device, ConvStateSpec) -> group
        self._where: dict[int, dict[str, tuple]] = {}
        for (kind, dev, spec), members in group_layers(layers, per_layer).items():
            groups = self._gdn if kind == "gdn" else self._conv
            groups[dev, spec] = _Group(spec, dev, members)
            for i, layer in enumerate(members):
                self._where.setdefault(id(layer), {})[kind] = ((dev, spec), i)
        #: where the shared bookkeeping lives: the first layer's device
        self.device = one
        self.devices = tuple(dict.fromkeys([self.device, *(g.device for g in (*self._gdn.values(),
                                                                              *self._conv.values()))]))
        #: several devices (the step's tensors are copied to each: :meth:`per_device`)
        self.spread = len(self.devices) > 1
        if self.spread and self.device.type == "meta":
            raise ValueError(f"StatePool: device: the first layer is on meta and others on "
                             f"{', '.join(str(d) for d in self.devices[1:])}; the first layer's device holds the "
                             "step's bookkeeping (folded mode's pending counts, the metadata, the accepted counts "
                             "that commit's validation reads back) and meta holds no values: put a layer on a real "
                             "device first")
        #: launches of CUDA groups run under their device (:func:`needs_launch_guard`, :meth:`launch_guard`)
        self.guarded = needs_launch_guard(self.devices)
        T, dev = self.max_tokens, self.device
        S = self.num_slots + (T + 1 if self.snapshot else 0)  # scratch slots and one dummy
        # per device, made once: the snapshot scratch slot of each token
        self._token_slots = {d: torch.arange(self.num_slots, self.num_slots + T, dtype=torch.int32, device=d)
                             for d in self.devices}
        for (dev, spec), group in self._gdn.items():
            nl, hv, h, k, v = len(group.members), spec.num_v_heads, spec.num_k_heads, spec.head_k_dim, spec.head_v_dim
            group.state = torch.zeros((nl, S, hv, k, v), dtype=dtype, device=dev)
            group.records = ReplayRecord(torch.zeros((nl, T, hv, v), device=dev),
                                         torch.zeros((nl, T, h, k), device=dev),
                                         torch.zeros((nl, T, hv), device=dev))
            if self.ring_mode:  # per-slot rings [NL, S, R, ...]
                ring = RecordRing.zeros(S, self.ring_positions, h, hv, k, v, dev)
                group.ring = RecordRing(*(torch.zeros((nl, *r.shape), device=dev) for r in ring))
            elif self.folded:  # the other half of the double buffer
                group.prev_records = ReplayRecord(*(torch.zeros_like(r) for r in group.records))
        for (dev, spec), group in self._conv.items():
            nl = len(group.members)
            group.state = torch.zeros((nl, S, spec.state_len, spec.channels), dtype=self.conv_dtype, device=dev)
            group.records = torch.zeros((nl, T, spec.channels), device=dev)
        for group in (*self._gdn.values(), *self._conv.values()):
            records = group.records if isinstance(group.records, tuple) else (group.records,)
            buffers = [group.state, *records, *(group.ring or ()), *(group.prev_records or ())]
            for t in buffers:
                # static sizes under torch.compile, whatever the pool's size: the ops get views of
                # these (a layer's slice, [layer, :tokens]) to write into, and with sizes made
                # dynamic inductor lowers such a view's storage offset to 0, so the writes landed
                # in the first layer's buffer (a fresh pool of another size makes dynamo's automatic
                # dynamic shapes do that by itself; pytorch/pytorch#198068)
                torch._dynamo.mark_static(t)
        #: folded pools: each slot's pending window (:class:`~ssm_spec.pools.pending.PendingWindows`)
        self.pending = PendingWindows(self)
        self._parity = 0

    # ------------------------------------------------------------------ lookup
    def _locate(self, layer, kind):
        try:
            key, index = self._where[id(layer)][kind]
        except KeyError:
            raise ValueError(f"StatePool: the layer {type(layer).__name__} has no {kind} state in this pool") from None
        return (self._gdn if kind == "gdn" else self._conv)[key], index

    def device_of(self, layer) -> torch.device:
        """The device holding ``layer``'s states (the device its forward must run on).

        Raises:
            ValueError: a layer the pool does not hold.
        """
        where = self._where.get(id(layer))
        if not where:
            raise ValueError(f"StatePool: the layer {type(layer).__name__} has no state in this pool")
        (device, _), _ = next(iter(where.values()))
        return device

    def gdn_state(self, layer) -> torch.Tensor:
        """``[S, HV, K, V]`` view of ``layer``'s recurrent states."""
        group, i = self._locate(layer, "gdn")
        return group.state[i]

    def gdn_record(self, layer, num_tokens: int) -> ReplayRecord:
        """Views ``[num_tokens, ...]`` of ``layer``'s record buffers."""
        group, i = self._locate(layer, "gdn")
        return ReplayRecord(*(r[i, :num_tokens] for r in group.records))

    def gdn_prev_record(self, layer) -> ReplayRecord:
        """Folded mode: views ``[max_tokens, ...]`` of ``layer``'s previous-step records."""
        group, i = self._locate(layer, "gdn")
        return ReplayRecord(*(r[i] for r in group.prev_records))

    def gdn_ring(self, layer) -> RecordRing:
        """Fast folded mode: views ``[S, R, ...]`` of ``layer``'s record ring."""
        group, i = self._locate(layer, "gdn")
        return RecordRing(*(r[i] for r in group.ring))

    @property
    def double_buffered(self) -> bool:
        """Whether the records alternate between two buffers across steps (the exact folded
        pool): a captured step then holds one parity."""
        return self.protocol.double_buffered

    def ring_bytes_per_slot(self) -> int:
        """Fast folded mode: bytes of record ring per slot and layer (0 otherwise)."""
        return sum(self.ring_positions * (s.num_v_heads * s.head_v_dim + s.num_k_heads * s.head_k_dim
                                          + s.num_v_heads) * 4 * len(g.members) for (_, s), g in self._gdn.items())

    def conv_state(self, layer) -> torch.Tensor:
        """``[S, Lc, C]`` view of ``layer``'s conv states."""
        group, i = self._locate(layer, "conv")
        return group.state[i]

    def conv_record(self, layer, num_tokens: int) -> torch.Tensor:
        """``[num_tokens, C]`` view of ``layer``'s recorded conv inputs."""
        group, i = self._locate(layer, "conv")
        return group.records[i, :num_tokens]

    def snapshot_slots(self, num_tokens: int, device=None) -> torch.Tensor:
        """Snapshot mode: ``[num_tokens]`` int32, the scratch slot of each token (a view), on
        ``device`` (one of :attr:`devices`, in any spelling :func:`placement_device` takes;
        default :attr:`device`).

        Raises:
            ValueError: a device the pool holds no group on.
        """
        slots = self._token_slots.get(self.device if device is None else device)
        if slots is None:
            slots = self._token_slots.get(placement_device(device))
            if slots is None:
                raise ValueError(f"StatePool.snapshot_slots: device {device!r}; this pool's devices are "
                                 f"{', '.join(map(str, self.devices))}")
        return slots[:num_tokens]

    @property
    def dummy_slot(self) -> int:
        """Snapshot mode: a scratch slot no token uses (a harmless copy target)."""
        return self.num_slots + self.max_tokens

    @property
    def gdn_groups(self):
        """``{(device, GDNStateSpec): (state [NL, S, HV, K, V], ReplayRecord [NL, T, ...])}``."""
        return {key: (g.state, g.records) for key, g in self._gdn.items()}

    @property
    def conv_groups(self):
        """``{(device, ConvStateSpec): (state [NL, S, Lc, C], records [NL, T, C])}``."""
        return {key: (g.state, g.records) for key, g in self._conv.items()}

    def gdn_group_items(self):
        """``(device, GDNStateSpec), group`` pairs of the GDN groups (each group's ``members``,
        ``state``, ``records``, ``prev_records`` and ``ring``): for the protocols' launches."""
        return self._gdn.items()

    def launch_guard(self, device: torch.device):
        """The context a launch of this pool's ops on ``device`` runs under: on a pool over
        several devices, or on a GPU that was not the current one when the pool was made
        (:attr:`guarded`), ``torch.cuda.device(device)`` for a CUDA device, because Triton
        launches on the current CUDA device and its current stream, not the tensors' (and
        accelerate's hooks move inputs without changing the current device); a new context
        manager each call, as they nest (a layer's step may flush the groups under their own
        devices). Otherwise ``contextlib.nullcontext()``: on a pool on the current GPU or the
        CPU, launches run as they are (nothing in a captured or compiled step's way), and the
        CPU's kernels take their device from their tensors."""
        if not self.guarded or device.type not in placement.CURRENT_DEVICE_TYPES:
            return contextlib.nullcontext()
        return torch.cuda.device(device)

    def launch(self, device: torch.device, name: str, *args) -> None:
        """Run ssm_spec op ``name`` on ``args`` (tensors on ``device``) for one of the pool's
        groups, under :meth:`launch_guard`."""
        with self.launch_guard(device):
            return _eager.call(name, *args)

    def per_device(self, *tensors: torch.Tensor) -> dict:
        """``{device: tensors on it}`` for every device of the pool: the tensors themselves on the
        device they are on, one copy for each other device (one launch per group then reads
        its own device's copy; on a pool on one device the tensors are used as they are). A
        copy to the CPU waits for the GPU, as every device-to-host copy does."""
        if not self.spread:
            return {self.device: tensors}
        return {d: tuple(t.to(d) for t in tensors) for d in self.devices}

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Zero the given slots of every state (a fresh request starts from the zero state).

        Args:
            slots: int tensor of distinct valid slots (the metadata's ``fresh_slots``), on any
                of the pool's devices; no host sync on a pool on one device (a pool on several
                copies it to each device).
        """
        if slots.numel() == 0:
            return
        index = {d: slots.to(device=d, dtype=torch.long) for d in self.devices}
        for group in (*self._gdn.values(), *self._conv.values()):
            group.state.index_fill_(1, index[group.device], 0)

    # ------------------------------------------------------------------ folded mode
    def swap_records(self) -> None:
        """Folded mode: this step's records become the previous step's (host-side pointer swap;
        :func:`ssm_spec.commit` calls it)."""
        for g in self._gdn.values():
            g.records, g.prev_records = g.prev_records, g.records
        self._parity ^= 1

    @property
    def record_parity(self) -> int:
        """Folded mode: which half of the double buffer this step's records go to (0 or 1); a
        captured step holds one parity, so graphs capture one step per parity."""
        return self._parity

    def set_record_parity(self, parity: int) -> None:
        if parity != self._parity:
            self.swap_records()

    # ------------------------------------------------------------------ pending windows
    @property
    def pending_start(self) -> torch.Tensor:
        """Folded pools: ``[num_slots + 1]`` int32, where each slot's pending tokens start."""
        return self.pending.pending_start

    @property
    def pending_count(self) -> torch.Tensor:
        """Folded pools: ``[num_slots + 1]`` int32, how many tokens each slot has pending."""
        return self.pending.pending_count

    def fold_plan(self, metadata, device=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Folded mode: the step's plan (:meth:`PendingWindows.fold_plan
        <ssm_spec.pools.pending.PendingWindows.fold_plan>`)."""
        return self.pending.fold_plan(metadata, device, layer)

    def lazy_plan(self, metadata, device=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fast folded mode: the step's plan (:meth:`PendingWindows.lazy_plan
        <ssm_spec.pools.pending.PendingWindows.lazy_plan>`)."""
        return self.pending.lazy_plan(metadata, device, layer)

    @torch.no_grad()
    def flush(self, slots=None) -> None:
        """Folded mode: commit the pending windows of ``slots`` (default: every slot) into their
        states now, one launch per GDN layer. Any time outside a step's forward: between steps,
        or between a step's forward and its commit (the rows that step verifies have handed
        their windows to it already), e.g. for requests that finish or are preempted, or
        before reading a state.

        Args:
            slots: slot numbers (list or int tensor); ``None``: all.

        Fast folded mode: any time outside a step's forward (the pending tokens of slots this
        step verified are those its verify did not fold; the commit then adds the accepted ones).

        Raises:
            ValueError: not a folded pool, or a slot out of range.
        """
        if not self.folded:
            self.protocol.flush(self, slots)  # raises: nothing is pending in this pool
        if slots is None:
            slots = torch.arange(self.num_slots, device=self.device)
        slots = slot_tensor("StatePool.flush", slots, self.num_slots, self.device)
        slots = torch.unique(slots)  # a slot named twice is committed once
        if slots.numel():
            self.protocol.flush(self, slots)

    def discard(self, slots=None) -> None:
        """Folded mode: drop the pending windows of ``slots`` (default: all) without committing
        them (a finished request whose state is not kept; a slot handed to a new request).

        Between a step's forward and its commit, the slots that step verified keep what their
        verify used, in both folded pools (the exact one's verify has taken the window over; a
        fast folded pool's verify read the pending tokens): discard them after the commit.

        Raises:
            ValueError: not a folded pool; slots that are not ints or lie outside
                ``0..num_slots - 1`` (one host read for a tensor).
        """
        self.protocol.discard(self, slots)
