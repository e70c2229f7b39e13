"""The RecoverSSM ops (docs/design.md section 4).

Importing this package registers ``torch.ops.ssm_spec.{gdn_verify, gdn_commit,
gdn_snapshot_verify, gdn_folded_verify, gdn_closed_form_verify,
gdn_closed_form_folded_verify, short_conv_verify, short_conv_commit}`` (CPU: PyTorch kernels; CUDA:
Triton kernels). The functions here are the friendly wrappers: they allocate outputs,
validate on the host (``validate=None``: on in eager, off while compiling or capturing) and
call the ops.
"""

from . import functional  # noqa: F401  (registers the functional verify ops)
from ._validate import NULL_SLOT
from .gdn import (
    RecordRing,
    ReplayRecord,
    gdn_closed_form_folded_verify,
    gdn_closed_form_verify,
    gdn_commit,
    gdn_folded_verify,
    gdn_snapshot_verify,
    gdn_verify,
)
from .short_conv import short_conv_commit, short_conv_verify

__all__ = [
    "NULL_SLOT",
    "RecordRing",
    "ReplayRecord",
    "gdn_closed_form_folded_verify",
    "gdn_closed_form_verify",
    "gdn_commit",
    "gdn_folded_verify",
    "gdn_snapshot_verify",
    "gdn_verify",
    "short_conv_commit",
    "short_conv_verify",
]
