"""Fast mode (docs/design.md section 2.6): the closed-form window verify and its lazy folded form.

``gdn_closed_form_verify`` computes a window's outputs and replay record from a read-only
checkpoint without the token loop's dependent chain: the state streams through once, in chunks
of key rows, and is contracted against the window's keys and queries (``2W`` products over
``K``, one FMA chain per output in key order), and the corrections solve the ``W x W`` unit
lower-triangular system in registers (:mod:`ssm_spec.reference_closed_form` is its float64
oracle). Its record is the exact verify's (fp32 ``u``, ``k̂``, ``d = exp(g)``), so
``gdn_commit`` and the grouped commit replay it.

``gdn_closed_form_folded_verify`` is the lazy commit's verify. Each slot owns a ring of
``R = max(max_pending, max_window) + max_window`` record positions (``u``, ``k̂`` and the log
decay ``g``) and keeps its last ``p <= max(max_pending, W)`` accepted tokens there instead of in
its state. Per row: if ``p > 0`` and ``p + W > max_pending`` (the window's accepted tokens could
pass ``max_pending``), the kernel adds the ``p`` pending tokens to each state chunk in closed
form, ``S_P = exp(G_P) S0 + sum_p exp(G_P - G_p) k̂_p u_p^T``, and stores it once (the fold);
otherwise it reads the state only and adds the pending tokens to the window's contractions in
closed form. Either way it then solves the window and appends the window's records right after
the pending ones. ``max_pending = 1`` folds at every step that has something pending: the
folded commit of fast mode.

Not bit-identical to the token loop (other roundings; the contract is a bound on the error
against a float64 run, tested). Every sum has an order written in code (key-order FMA chains,
:func:`~ssm_spec.ops.gdn.inner.kdot` for the norms and the Gram rows, token-order chains over
window and history tokens, explicit FMAs where a contraction could otherwise depend on the
layout), so bits do not depend on the tile or the batch.
"""

from .config import (  # noqa: F401  (scripts and tests import these from the package)
    HISTORY_CHUNK,
    MAX_REGISTERS,
    STATE_PREFETCH,
    STATE_STAGES,
    block_constants,
    history_chunk,
    key_chunk,
    pending_block,
    window_block,
)
from .kernel import closed_form_cpu, gdn_closed_form_kernel, launch_closed_form  # noqa: F401
from .ring import RecordRing, ring_positions
from .verify import gdn_closed_form_folded_verify, gdn_closed_form_verify

__all__ = ["RecordRing", "gdn_closed_form_folded_verify", "gdn_closed_form_verify", "ring_positions"]
