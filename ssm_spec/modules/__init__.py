"""Drop-in layers: the GDN layer with Hugging Face weights and the PLE short conv."""

from .gdn import GatedRMSNorm, RecoverGatedDeltaNet
from .short_conv import RecoverShortConv

__all__ = ["GatedRMSNorm", "RecoverGatedDeltaNet", "RecoverShortConv"]
