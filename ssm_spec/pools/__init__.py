"""State pools (docs/design.md sections 5.3, 5.6-5.9): :class:`StatePool` holds every layer's
states and record buffers (:mod:`.storage`), placed on devices by :mod:`.placement`, run through
one protocol per pool mode (:mod:`.protocols`), with folded pools' pending windows kept by
:mod:`.pending`."""

from ..ops import NULL_SLOT
from .pending import PendingWindows
from .placement import CURRENT_DEVICE_TYPES, group_layers, needs_launch_guard, placement_device
from .protocols import (MODES, STATE_DTYPES, Exact, Fast, Folded, Lazy, Protocol, Snapshot, check_mode,
                        check_state_dtype, make_protocol, plan_commit)
from .storage import ConvStateSpec, GDNStateSpec, StatePool

__all__ = ["StatePool", "GDNStateSpec", "ConvStateSpec", "NULL_SLOT", "MODES", "STATE_DTYPES", "placement_device",
           "group_layers", "needs_launch_guard", "CURRENT_DEVICE_TYPES", "PendingWindows", "Protocol", "Exact",
           "Snapshot", "Folded", "Fast", "Lazy", "make_protocol", "plan_commit", "check_mode", "check_state_dtype"]
