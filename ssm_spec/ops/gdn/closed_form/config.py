"""The closed-form kernel's launch constants: the block constexprs of a launch
(:func:`block_constants`) and the tuning knobs behind them (register cap, key rows per chunk,
the state loop's pipelining), each with its one-line reason; the measurements are in
docs/perf-notes.md."""

from __future__ import annotations

import numbers

from ..tiles import next_power_of_2


#: Register cap of the closed-form kernel (``maxnreg``): 16 one-warp programs per SM, so their
#: state loads overlap; measured faster on the H200 (docs/perf-notes.md, "The closed-form
#: constants"). Not passed to the Triton interpreter.
MAX_REGISTERS = 128


def key_chunk(BK: int, WP: int) -> int:
    """Key rows per chunk of the closed-form kernel's state loop (a power of two <= ``BK``), the
    same for the plain and the ring forms.

    The window's keys and queries on a chunk, ``2 * KC * WP`` values, are replicated in every
    thread, so past a window block of 4 the chunk shrinks as the window grows (a block of 1 keeps
    4 rows: not measured at 8). Each block's chunk measured fastest on the H200, in the plain and
    the ring forms (docs/perf-notes.md, "The closed-form constants"). Bits do not depend on it (one
    FMA chain over the key axis whatever the chunk)."""
    kc = 8 if WP in (2, 4) else (4 if WP <= 8 else 2)
    return max(1, min(kc, BK))


def history_chunk(BK: int) -> int:
    """Key rows per chunk of the history path's loop (the window's raw keys and queries against
    the pending ``k̂``, after the state loop). Bits do not depend on it (one FMA chain over the
    key axis whatever the chunk)."""
    return max(1, min(HISTORY_CHUNK, BK))


#: Key rows per chunk of the history products' loop (:func:`history_chunk`).
HISTORY_CHUNK = 4

#: ``num_stages`` of the state loop (``tl.range``): 1 compiles the loop as before (the same
#: instructions as a plain ``range``, offline); 2 makes Triton copy the next chunk's state and
#: keys to shared memory asynchronously (``LDGSTS``) while the current chunk computes, at the
#: cost of more registers; 2 stages measured slower or tied on the H200 in every form
#: (docs/perf-notes.md "v7"). Bits do not depend on it (same arithmetic in the same order; the
#: sweep checks them).
STATE_STAGES = 1

#: Whether the state loop loads the next chunk's state rows into registers before the current
#: chunk's FMAs (``PREFETCH``), so each program keeps a chunk's loads in flight while it computes.
#: Costs one more chunk of registers; measured slower or within noise on the H200 at each form's
#: default chunk, so off (docs/perf-notes.md "v8"). Bits do not depend on it (the same values
#: reach the same FMAs; the sweep checks them).
STATE_PREFETCH = False


def window_block(max_window: int) -> int:
    """The kernel's window block ``WP = next_pow2(max(1, max_window))`` (a constexpr: one
    binary per power of two)."""
    return next_power_of_2(max(1, int(max_window)))


def pending_block(positions: int, max_window: int) -> int:
    """The kernel's pending block ``PP = next_pow2(R - max_window)`` (at least 1). A valid pending
    count is at most ``R - max_window`` (validated); kernel and twin clamp a count to that, so the
    window's records never overwrite a pending record another program may still read, and an
    unvalidated count gives the same result in every tile."""
    return next_power_of_2(max(1, int(positions) - int(max_window)))



def _check_int(name: str, value, upper: int | None = None) -> None:
    """``value`` is None or an int (not a bool) in ``1..upper``; else a ``ValueError`` naming it."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"launch_closed_form: {name}: got {value!r}; expected an int")
    if upper is not None and not 0 < int(value) <= upper:
        raise ValueError(f"launch_closed_form: {name}: got {value!r}; expected an int in 1..{upper}")


def block_constants(BK: int, max_window: int, positions: int, ring: bool, key_rows: int | None = None,
                    stages: int | None = None, prefetch: bool | None = None) -> dict:
    """The block constexprs of :func:`~.kernel.gdn_closed_form_kernel` for a launch (and for
    ``scripts/offline_sass.py``, which compiles the same binary): ``WP`` (:func:`window_block`),
    ``PP`` (:func:`pending_block` of the ring's ``positions``; 1 without a ring), ``KC``
    (:func:`key_chunk`, or ``key_rows``), ``KH`` (:func:`history_chunk`), ``STAGES`` (the
    state loop's ``num_stages``: :data:`STATE_STAGES`, or ``stages``) and ``PREFETCH`` (the
    next chunk's state rows loaded a chunk ahead: :data:`STATE_PREFETCH`, or ``prefetch``).

    Raises:
        ValueError: ``key_rows`` not a power of two in ``1..BK``; ``stages`` below 1; either not
            an ``int``; ``prefetch`` not a bool.
    """
    _check_int("key_rows", key_rows)
    _check_int("stages", stages)
    WP = window_block(max_window)
    KC = key_chunk(BK, WP) if key_rows is None else int(key_rows)
    if KC < 1 or KC > BK or KC & (KC - 1):
        raise ValueError(f"launch_closed_form: key_rows: got {key_rows}; expected a power of two <= BK ({BK})")
    STAGES = STATE_STAGES if stages is None else int(stages)
    if STAGES < 1:
        raise ValueError(f"launch_closed_form: stages: got {stages}; expected 1 or more")
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(f"launch_closed_form: prefetch: got {prefetch!r}; expected a bool")
    return dict(WP=WP, PP=pending_block(positions, max_window) if ring else 1, KC=KC, KH=history_chunk(BK),
                STAGES=STAGES, PREFETCH=STATE_PREFETCH if prefetch is None else prefetch)
