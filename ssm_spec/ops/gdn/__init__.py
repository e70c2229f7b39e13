"""Gated DeltaNet ops: verify, commit, the folded verify, and the native snapshot path."""

from .commit import gdn_commit
from .folded import gdn_folded_verify
from .snapshot import gdn_snapshot_verify
from .verify import ReplayRecord, gdn_verify

__all__ = ["ReplayRecord", "gdn_commit", "gdn_folded_verify", "gdn_snapshot_verify", "gdn_verify"]
