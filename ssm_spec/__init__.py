"""ssm-spec: RecoverSSM speculative decoding for Gated DeltaNet and short-conv layers.

Verify runs a draft window from a read-only checkpoint and records a small fp32 replay record
per token; commit, once the accepted count is known, replays only the accepted tokens and
writes the state once. See docs/design.md for the design.
"""

from ._lazy import command_line, lazy_attributes

if command_line():  # `ssm-spec --help` needs no torch: each name loads on first use (ssm_spec/_lazy.py)
    __getattr__ = lazy_attributes(__name__, {
        "NULL_SLOT": "ops", "RecoverGatedDeltaNet": "modules", "RecoverSSMMetadata": "metadata",
        "RecoverShortConv": "modules", "ReplayRecord": "ops", "StatePool": "pools", "commit": "step", "ops": "ops",
        "reference": "reference"})
else:
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
