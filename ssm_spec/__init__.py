"""ssm-spec: RecoverSSM speculative decoding for Gated DeltaNet and short-conv layers.

Verify runs a draft window from a read-only checkpoint and records a small fp32 replay record
per token; commit, once the accepted count is known, replays only the accepted tokens and
writes the state once. See docs/design.md for the design.
"""

from . import ops, reference
from .metadata import RecoverSSMMetadata
from .modules import RecoverGatedDeltaNet, RecoverShortConv
from .ops import NULL_SLOT, ReplayRecord
from .pools import StatePool
from .step import commit

__version__ = "0.1.0"

__all__ = [
    "NULL_SLOT",
    "RecoverGatedDeltaNet",
    "RecoverSSMMetadata",
    "RecoverShortConv",
    "ReplayRecord",
    "StatePool",
    "commit",
    "ops",
    "reference",
    "__version__",
]
