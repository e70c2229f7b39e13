"""``StatePool``: every layer's recurrent and conv states, and the replay record buffers.

States are stacked per ``(device, shape)`` group with a leading layer dim, so one grouped commit
launch covers every GDN layer of a group and one covers every conv layer of a shape on a device
(docs/design.md sections 5.3 and 5.9). The record buffers ``[NL, max_tokens, ...]`` live outside
the state pages: a record lives only from a step's verify to its commit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .ops import NULL_SLOT, RecordRing, ReplayRecord, _eager
from .ops.gdn.closed_form import ring_positions

__all__ = ["StatePool", "GDNStateSpec", "ConvStateSpec", "NULL_SLOT", "MODES", "placement_device", "group_layers",
           "needs_launch_guard"]

#: Device types whose ssm_spec kernels (Triton) launch on the *current* device of their type, not
#: on their tensors' device; a pool over several devices launches a group's ops there under
#: ``torch.cuda.device(group device)`` (:meth:`StatePool.launch_guard`). PyTorch's own ops take
#: their device from their tensors and need nothing.
CURRENT_DEVICE_TYPES = ("cuda",)


def needs_launch_guard(devices) -> bool:
    """Whether a pool on ``devices`` (its :attr:`StatePool.devices`) launches under its groups'
    devices: when it spans several devices, one of a type in :data:`CURRENT_DEVICE_TYPES`, or
    when its one device is a GPU other than the current one as it is made (a model placed on
    ``cuda:1`` alone by a device map, run while ``cuda:0`` is current). A pool on the current
    GPU, or on the CPU, launches as it is: nothing in the way of its captured or compiled step."""
    devices = tuple(devices)
    if len(devices) > 1:
        return any(d.type in CURRENT_DEVICE_TYPES for d in devices)
    return devices[0].type == "cuda" and devices[0].index != torch.cuda.current_device()


#: The verify modes (docs/design.md section 2.6): ``"exact"`` (the token loop, bit-identical to the
#: native recurrence; the default) and ``"fast"`` (the closed-form window, within a stated error
#: bound, and with a folded pool the lazy commit).
MODES = ("exact", "fast")


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


def placement_device(device) -> torch.device:
    """``device`` (a ``torch.device``, a string such as ``"cuda:1"``, or an accelerator index)
    as the one ``torch.device`` that names it in a pool's group keys: ``"cuda"`` (no index)
    becomes the current CUDA device (``cuda:0`` where CUDA is absent), ``"cpu:0"`` becomes
    ``"cpu"``, an int ``i`` becomes ``cuda:i``. Needs no GPU.

    Raises:
        ValueError: not a device.
    """
    if isinstance(device, bool):
        raise ValueError(f"StatePool: device: got {device!r}; expected a torch.device, a string or an index")
    if isinstance(device, int):
        return torch.device("cuda", device)
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"StatePool: device: got {device!r}; expected a torch.device, a string or an index "
                         f"({exc})") from None
    if d.type == "cpu":
        return torch.device("cpu") if d.index is not None else d
    if d.index is None and d.type != "meta":
        index = torch.cuda.current_device() if d.type == "cuda" and torch.cuda.is_available() else 0
        return torch.device(d.type, index)
    return d


def group_layers(layers, devices) -> dict:
    """The pool's grouping: ``{(kind, device, spec): [layer, ...]}`` over every state of every
    layer (``kind``: ``"gdn"`` or ``"conv"``; ``spec``: its :class:`GDNStateSpec` /
    :class:`ConvStateSpec`), groups and members in order of first appearance. Layers on two
    devices never share a group; layers of two shapes never do either.

    Args:
        layers: modules with ``state_specs()``.
        devices: one device per layer (anything :func:`placement_device` takes).

    Raises:
        ValueError: ``devices`` not one per layer, or not devices.
    """
    layers, devices = list(layers), list(devices)
    if len(devices) != len(layers):
        raise ValueError(f"StatePool: device: got {len(devices)} devices for {len(layers)} layers; expected one "
                         "device, or one per layer")
    groups: dict = {}
    for layer, device in zip(layers, devices):
        d = placement_device(device)
        for kind, spec in layer.state_specs():
            groups.setdefault((kind, d, spec), []).append(layer)
    return groups


@dataclass
class _Group:
    spec: object
    device: torch.device
    members: list = field(default_factory=list)
    state: torch.Tensor | None = None
    records: tuple | None = None
    prev_records: tuple | None = None
    ring: RecordRing | None = None


def _slot_tensor(op: str, slots, num_slots: int, device) -> torch.Tensor:
    """``slots`` (ints, a list of them or an integer tensor) as an int32 tensor on ``device``.

    Raises:
        ValueError: not integers, or a slot outside ``0..num_slots - 1``.
    """
    t = torch.as_tensor(slots)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{op}: slots: got {slots!r}; expected slot numbers (ints)")
    t = t.to(device=device, dtype=torch.int32).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_slots):
        raise ValueError(f"{op}: slots: got {t.tolist()}; expected 0..{num_slots - 1}")
    return t


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
        self.snapshot = bool(snapshot)
        self.folded = bool(folded)
        if self.snapshot and self.folded:
            raise ValueError("StatePool: snapshot and folded are two different protocols; choose one")
        if mode not in MODES:
            raise ValueError(f"StatePool: mode: got {mode!r}; expected one of {MODES}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"StatePool: max_pending: got {max_pending!r}; expected an int >= 1")
        if max_pending > 1 and not (mode == "fast" and self.folded):
            raise ValueError("StatePool: max_pending > 1 (the lazy commit) needs mode='fast' and folded=True")
        if mode == "fast" and self.snapshot:
            raise ValueError("StatePool: snapshot is the native protocol; mode='fast' is a RecoverSSM mode")
        self.mode = mode
        self.max_pending = int(max_pending)
        self.max_window = int(max_tokens if max_window is None else max_window)
        if not 1 <= self.max_window <= self.max_tokens:
            raise ValueError(f"StatePool: max_window: got {max_window}; expected 1..max_tokens ({self.max_tokens})")
        #: fast folded mode: records live in per-slot rings (the lazy commit)
        self.ring_mode = mode == "fast" and self.folded
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
        # folded mode: per slot, where its pending window starts in the previous step's records
        # and how many of its tokens to commit (entry num_slots: a sink for padding rows)
        dev = self.device
        self.pending_start = torch.zeros(self.num_slots + 1, dtype=torch.int32, device=dev)
        self.pending_count = torch.zeros(self.num_slots + 1, dtype=torch.int32, device=dev)
        self._pending_host: set[int] | None = set()  # host mirror while commits validate
        self._plan: tuple | None = None  # (metadata, plan on self.device, {other device: copy of the plan})
        self._plan_layers: set[int] = set()  # the layers that took the current plan (ids)
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
        return self.folded and not self.ring_mode

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
        if not self.guarded or device.type not in CURRENT_DEVICE_TYPES:
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

    def fold_plan(self, metadata, device=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Folded mode: ``(prev_start [B], prev_num_accepted_tokens [B])`` int32 for the step's
        verify rows (0 for padding and prefill rows), computed on :attr:`device` once per step
        (the layers call it before they write anything) and returned on ``device`` (default
        :attr:`device`; a layer on another device gets a copy, made once per step and device).

        The step is recognised by its metadata object: every layer of a step must pass the same
        one (``layer``: the calling layer, so that a second metadata object within one step,
        such as a per-device copy, is refused instead of redoing the plan from cleared counts).

        Taking the plan hands the verified rows' pending windows to this step: their counts are
        cleared at once, so a :meth:`flush` before the step's commit cannot commit them twice.
        A fresh request's slot (a verify row with ``num_computed_tokens == 0``, or a prefill row
        from the zero state) drops whatever window a finished request left pending there.

        Raises:
            ValueError: a prefill row continuing from a slot with a pending window (flush it
                first); detected while the host mirror is known, i.e. while commits validate.
                A ``layer`` that has not taken this step's plan passing another metadata object
                (:meth:`_check_step`). Raised before anything is written.
        """
        if self._plan is not None:
            if self._plan[0] is metadata:
                return self._plan_on(device, layer)
            self._check_step(layer)
        if self._pending_host:
            for row in metadata.prefill_rows:
                if row.src >= 0 and row.src in self._pending_host:
                    raise ValueError(f"StatePool: slot {row.src} has a pending window (folded mode) and a prefill "
                                     f"row of this step continues from it; flush it first "
                                     f"(pool.flush([{row.src}]))")
        idx = self._release_fresh(metadata)
        if not metadata.has_verify:
            return self._plan_on(device, layer)
        plan = (self.pending_start[idx], self.pending_count[idx])  # gathered copies
        self.pending_count.index_fill_(0, idx, 0)  # handed to this step's verify
        self._set_plan(metadata, plan)
        return self._plan_on(device, layer)

    def _set_plan(self, metadata, plan) -> None:
        self._plan = (metadata, plan, {})
        self._plan_layers = set()

    def _check_step(self, layer) -> None:
        """A plan is asked for with another metadata object than the current plan's: a new step,
        unless ``layer`` has not taken the current plan yet (then it is the same step, and a
        second plan would start from the counts the first one cleared: the pending windows
        would be lost). Host-side only (a set lookup); ``layer=None`` checks nothing."""
        if layer is not None and id(layer) not in self._plan_layers:
            raise ValueError(f"StatePool: {type(layer).__name__} got another metadata object than the layers before "
                             "it in this step (a folded pool recognises a step by its metadata object): pass the "
                             "same RecoverSSMMetadata, built on pool.device, to every layer of a step (layers on "
                             "other devices copy it themselves)")

    def _plan_on(self, device, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The current step's plan on ``device`` (``layer`` takes it): the plan itself on
        :attr:`device`, else a copy made at the first call for that device."""
        if layer is not None:
            self._plan_layers.add(id(layer))
        _, plan, copies = self._plan
        if device is None or device == self.device:
            return plan
        got = copies.get(device)
        if got is None:
            got = copies[device] = tuple(t.to(device) for t in plan)
        return got

    def lazy_plan(self, metadata, device=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fast folded mode: ``(pending_start [B], pending_count [B])`` int32 of the step's verify
        rows (0 for padding and prefill rows), for the layers' ``gdn_closed_form_folded_verify``;
        computed on :attr:`device` once per step (the first layer calls it, before anything is
        written) and returned on ``device`` as :meth:`fold_plan` does. It also moves each slot's
        bookkeeping past this step's verify: a row that folds (``count > 0`` and ``count + W >
        max_pending``) has consumed its pending tokens (its ring now starts after them, count
        0); :func:`ssm_spec.commit` then adds the accepted tokens, whose records the verify wrote
        right after the pending ones.

        A prefill row continuing from a slot flushes that slot first (the prefill reads its
        state); a fresh request's slot drops whatever a finished request left pending there.
        Every layer of a step passes the same metadata object, as for :meth:`fold_plan`.

        Raises:
            ValueError: a verify window longer than the pool's ``max_window``; a ``layer`` that
                has not taken this step's plan passing another metadata object.
        """
        if self._plan is not None:
            if self._plan[0] is metadata:
                return self._plan_on(device, layer)
            self._check_step(layer)
        if metadata.max_window > self.max_window:
            raise ValueError(f"StatePool: a verify window of {metadata.max_window} tokens; this fast folded pool's "
                             f"rings hold windows up to max_window={self.max_window}")
        cont = sorted({row.src for row in metadata.prefill_rows if row.src >= 0})
        if cont:
            self.flush(cont)
        idx = self._release_fresh(metadata)
        if not metadata.has_verify:
            return self._plan_on(device, layer)
        start, count = self.pending_start[idx], self.pending_count[idx]  # gathered copies
        qsl = metadata.to(self.device).verify_query_start_loc
        W = (qsl[1:] - qsl[:-1]).to(torch.int32)
        fold = (count > 0) & (count + W > self.max_pending)
        self.pending_start.index_copy_(0, idx, torch.where(fold, (start + count) % self.ring_positions, start))
        self.pending_count.index_copy_(0, idx, torch.where(fold, torch.zeros_like(count), count))
        self.pending_start[self.num_slots:].zero_()  # the sink holds nothing
        self.pending_count[self.num_slots:].zero_()
        self._set_plan(metadata, (start, count))
        return self._plan_on(device, layer)

    def note_accepted(self, metadata, num_accepted_tokens: torch.Tensor) -> None:
        """Fast folded mode (called by :func:`ssm_spec.commit`): each verify row's accepted
        tokens join its slot's pending ones (no state written, no host sync)."""
        idx = self._sink(metadata.verify_indices)
        self.pending_count.index_add_(0, idx, num_accepted_tokens.to(device=self.device, dtype=torch.int32))
        self.pending_count[self.num_slots:].zero_()
        self._plan = None

    def _release_fresh(self, metadata) -> torch.Tensor:
        """Both folded plans' common start: a fresh request's slot (a prefill row from the zero
        state, a verify row with ``num_computed_tokens == 0``) drops what a finished request left
        pending there. Returns the verify rows' slots (padding rows: the sink). When every verify
        window is empty no kernel runs, so nothing is handed over: the plan (cached) is zeros."""
        fresh = [row.dst for row in metadata.prefill_rows if row.src < 0]
        if fresh:
            self.discard(fresh)
        if metadata.fresh_slots.numel():
            self.pending_count.index_fill_(0, metadata.fresh_slots.to(device=self.device, dtype=torch.long), 0)
        idx = self._sink(metadata.verify_indices)
        if not metadata.has_verify:
            zeros = torch.zeros_like(idx, dtype=torch.int32)
            self._set_plan(metadata, (zeros, zeros.clone()))
        return idx

    def _sink(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(device=self.device, dtype=torch.long)
        return torch.where(slots >= 0, slots, torch.full_like(slots, self.num_slots)).clamp_max(self.num_slots)

    def note_pending(self, metadata, num_accepted_tokens: torch.Tensor, host_counts=None) -> None:
        """Folded mode (called by :func:`ssm_spec.commit`): each verify row's window becomes its
        slot's pending window with its accepted count, then the record buffers swap. No host
        sync; ``host_counts`` (the validated counts) keeps the host mirror."""
        idx = self._sink(metadata.verify_indices)
        self.pending_start.index_copy_(0, idx, metadata.to(self.device).verify_query_start_loc[:-1].to(torch.int32))
        self.pending_count.index_copy_(0, idx, num_accepted_tokens.to(device=self.device, dtype=torch.int32))
        self.pending_count[self.num_slots:].zero_()  # the sink holds nothing
        if host_counts is None or self._pending_host is None:
            self._pending_host = None  # unknown from here on: no host-side checks
        else:
            slots, counts = host_counts
            self._pending_host = {s for s, n in zip(slots, counts) if s >= 0 and n > 0}
        self._plan = None
        self.swap_records()

    def check_pending_verified(self, verify_slots: list[int]) -> None:
        """Folded mode, commit-time check (host mirror known): every slot pending from the last
        step was verified in this one (its window got folded); otherwise its records would be
        overwritten by the next step.

        Raises:
            ValueError: a pending slot this step did not verify (nothing written; flush it, then
                commit again).
        """
        if self._pending_host:
            missing = sorted(self._pending_host - set(verify_slots))
            if missing:
                raise ValueError(f"commit: slots {missing} have pending windows (folded mode) that this step "
                                 f"did not verify; flush them first (pool.flush({missing})), then commit")

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
            raise ValueError("StatePool.flush: only a folded pool (StatePool(folded=True)) has pending windows")
        if slots is None:
            slots = torch.arange(self.num_slots, device=self.device)
        slots = _slot_tensor("StatePool.flush", slots, self.num_slots, self.device)
        slots = torch.unique(slots)  # a slot named twice is committed once
        B = slots.numel()
        if B == 0:
            return
        idx = slots.long()
        start, count = self.pending_start[idx], self.pending_count[idx]
        qsl = torch.zeros(B + 1, dtype=torch.int32, device=self.device)  # empty windows: fold only
        on = self.per_device(slots, qsl, start, count)  # each group launches on its own device
        if self.ring_mode:  # max_pending 0: every row with pending tokens folds. max_window the pool's
            # (the windows are empty either way): the pending block PP = next_pow2(R - max_window) is
            # then the tightest that holds every valid count, and a step whose window is the pool's
            # longest launched the same binary (0 would be PP = next_pow2(R): up to twice the block,
            # and a binary of its own to compile on first use)
            for (dev, spec), g in self._gdn.items():
                H, HV, K, V = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
                d_slots, d_qsl, d_start, d_count = on[dev]
                empty = torch.empty(0, device=dev)
                q, v, gb = empty.reshape(0, H, K), empty.reshape(0, HV, V), empty.reshape(0, HV)
                for layer in range(len(g.members)):
                    self.launch(dev, "gdn_closed_form_folded_verify", q, q, v, gb, gb, g.state[layer], d_slots,
                                d_qsl, v, *(r[layer] for r in g.ring), d_start, d_count, self.max_window, 0,
                                K ** -0.5, True)
            self.pending_start.index_copy_(0, idx, (start + count) % self.ring_positions)
            self.pending_count.index_fill_(0, idx, 0)
            return
        for (dev, spec), g in self._gdn.items():
            H, HV, K, V = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
            d_slots, d_qsl, d_start, d_count = on[dev]
            empty = torch.empty(0, device=dev)
            q = empty.reshape(0, H, K)
            v = empty.reshape(0, HV, V)
            for layer in range(len(g.members)):
                prev = [r[layer] for r in g.prev_records]
                self.launch(dev, "gdn_folded_verify", q, q, v, empty.reshape(0, HV), empty.reshape(0, HV),
                            g.state[layer], d_slots, d_qsl, v, v.clone(), q.clone(), empty.reshape(0, HV), *prev,
                            d_start, d_count, K ** -0.5, True)
        self.pending_count.index_fill_(0, idx, 0)
        if self._pending_host is not None:
            self._pending_host -= set(slots.tolist())

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
        if not self.folded:
            raise ValueError("StatePool.discard: only a folded pool (StatePool(folded=True)) has pending windows")
        if slots is None:
            slots = torch.arange(self.num_slots, device=self.device)
        idx = _slot_tensor("StatePool.discard", slots, self.num_slots, self.device).long()
        if self.ring_mode and self._plan is not None:  # a step in flight: the slots it verified keep the
            # tokens their verify used (as the exact folded pool's verify took its window over)
            busy = set(self._plan[0].verify_indices.tolist())
            idx = torch.tensor([s for s in idx.tolist() if s not in busy], dtype=torch.long, device=self.device)
        if self.ring_mode:  # the ring moves past the dropped tokens: a window verified this step (records
            # right after them) is what the commit's accepted tokens point at
            self.pending_start.index_copy_(0, idx, (self.pending_start[idx] + self.pending_count[idx])
                                           % self.ring_positions)
        self.pending_count.index_fill_(0, idx, 0)
        if self._pending_host is not None:
            self._pending_host -= set(idx.tolist())
