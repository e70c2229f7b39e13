"""A back-reference from a part to the object holding it, without a reference cycle."""

from __future__ import annotations

import weakref

__all__ = ["BackRef"]


class BackRef:
    """A weak reference to ``target`` (call it for the object, ``None`` once it is gone) that a
    copy or pickle takes as a strong one.

    A part held by its owner (a pool's pending-window bookkeeping, a cache's layer) points back
    through one of these, so the owner and its buffers go when its last user drops it, without
    waiting for a garbage-collection pass. ``copy.deepcopy`` and ``pickle`` rebuild it from the
    target itself, which they have already copied (memoised): a copied part points at the copied
    owner, not the original.
    """

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, target):
        self._ref = weakref.ref(target)

    def __call__(self):
        return self._ref()

    def __reduce__(self):
        return BackRef, (self._ref(),)
