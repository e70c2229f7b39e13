"""Causal (dilated) depthwise short conv ops: verify and commit."""

from .commit import short_conv_commit
from .verify import short_conv_verify

__all__ = ["short_conv_commit", "short_conv_verify"]
