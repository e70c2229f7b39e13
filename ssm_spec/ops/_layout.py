"""The windows a record was made with, so that a validated commit can refuse other windows.

A record (:class:`~ssm_spec.ops.ReplayRecord`, or short conv's ``rec_x``) holds one row per
token of its verify; which tokens form which row's window is the verify's
``query_start_loc``. A commit given another ``query_start_loc`` would replay tokens of other
windows (or another row's) and write a wrong state. The friendly verify wrappers, when they
validate (they read ``query_start_loc`` on the host then anyway), remember its windows here,
keyed weakly by the record's first tensor; the commit wrappers, when they validate, compare.
Nothing is remembered or read with validation off (compiling, capturing), so this costs no host
sync there. The ops themselves forget the buffers they write (a record refilled by a later op
call may hold other windows), so a record is checked only while it still holds what its
wrapper call wrote.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["forget", "made_with", "remember"]

_WINDOWS = WeakTensorKeyDictionary()


def remember(record: torch.Tensor, windows: list[tuple[int, int]]) -> None:
    """Record that ``record`` (a record's first tensor) holds the windows ``[(bos, eos)]`` of
    each row (:func:`~ssm_spec.ops._validate.window_bounds`'s)."""
    _WINDOWS[record] = list(windows)


def forget(record: torch.Tensor) -> None:
    """``record`` is being rewritten (by an op call): its windows are no longer known."""
    if _WINDOWS:  # nothing to look up on the modules' hot path, where no wrapper remembered any
        _WINDOWS.pop(record, None)


def made_with(record) -> list[tuple[int, int]] | None:
    """The windows ``[(bos, eos)]`` ``record`` was made with, or None where not known (a
    record built or refilled elsewhere, a stacked or sliced one)."""
    return _WINDOWS.get(record) if isinstance(record, torch.Tensor) else None
