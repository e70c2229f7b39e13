"""Gated DeltaNet ops: verify, commit, the folded verify, the native snapshot path, and fast
mode's closed-form verify and its lazy folded form."""

from .closed_form import RecordRing, gdn_closed_form_folded_verify, gdn_closed_form_verify
from .commit import gdn_commit
from .folded import gdn_folded_verify
from .record import ReplayRecord
from .snapshot import gdn_snapshot_verify
from .verify import gdn_verify

__all__ = ["RecordRing", "ReplayRecord", "gdn_closed_form_folded_verify", "gdn_closed_form_verify", "gdn_commit",
           "gdn_folded_verify", "gdn_snapshot_verify", "gdn_verify"]
