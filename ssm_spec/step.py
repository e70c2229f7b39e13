"""``commit``: after sampling, commit every verify row of every layer in one launch per group
(a group: the layers of one state shape on one device).

The plan (source, destination and boundary slots per row) is computed on the device from the
step's metadata and the accepted counts, so, with validation off (``validate=False``, as in
captured and compiled steps), no host sync sits between sampling and commit on a pool on one
device or spread over GPUs only (docs/design.md section 5.5). A pool with groups on a GPU and on
the CPU copies the plan to the CPU for the CPU's groups: that device-to-host copy waits for the
GPU's sampling, as every such copy does (section 5.9). Validation (the eager default) reads the
counts back on the host.
"""

from __future__ import annotations

import torch

from .metadata import RecoverSSMMetadata
from .ops._validate import should_validate
from .pools import StatePool
from .pools.protocols import plan_commit, validate_commit

__all__ = ["commit", "plan_commit"]


def commit(pool: StatePool, metadata: RecoverSSMMetadata, num_accepted_tokens: torch.Tensor,
           validate: bool | None = None) -> None:
    """Commit the accepted tokens of every verify row into every layer's states.

    One grouped ``gdn_commit`` launch per GDN state group and one ``short_conv_commit`` per
    conv shape group, each on its group's device; prefill and padding rows take no part. With a
    folded pool (``StatePool(folded=True)``) the GDN states are not written here: each row's count is
    noted on the device and the next step's verify commits it (see :class:`~ssm_spec.StatePool`);
    in fast mode (``mode="fast"``) the records replayed are the closed-form verify's, and a fast
    folded pool keeps the accepted tokens pending in its rings (the lazy commit).

    Args:
        pool: the :class:`~ssm_spec.StatePool` the step's layers verified against.
        metadata: the step's :class:`~ssm_spec.RecoverSSMMetadata` (the same object the layers
            got), on ``pool.device``.
        num_accepted_tokens: ``[B]`` int32 on the device (a pool spread over devices: on
            ``pool.device``; the plan is copied once to each other device), ``0 <= n[b] <=
            window length`` (``0``: a discarded step, nothing written).
        validate: check the counts on the host (``None``: in eager mode only).

    Raises:
        ValueError: with validation on, a ``num_accepted_tokens`` not of shape ``[B]`` or a count
            outside its window; snapshot mode with align mode; a folded pool with align mode or
            with a slot whose pending window this step did not verify. Nothing is written.
    """
    checked = validate_commit(pool, metadata, num_accepted_tokens) if should_validate(validate, "commit") else None
    if metadata.has_verify:
        pool.protocol.commit(pool, metadata, num_accepted_tokens.to(torch.int32), checked)
