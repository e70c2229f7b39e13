"""Gated DeltaNet ops: verify, commit, and the native snapshot path."""

from .commit import gdn_commit
from .snapshot import gdn_snapshot_verify
from .verify import ReplayRecord, gdn_verify

__all__ = ["ReplayRecord", "gdn_commit", "gdn_snapshot_verify", "gdn_verify"]
