"""The checkpoint's own MTP head as a drafter (docs/design.md section 7.8).

:class:`MTPHead` is the Qwen3-Next / Qwen3.5 multi-token-prediction head built from the target's
transformers classes (:mod:`.head`); :func:`load_mtp_head` reads its ``mtp.*`` tensors from the
checkpoint (:mod:`.load`). ``generate(..., use_mtp=True, num_assistant_tokens=k)`` on a converted
model drafts ``k`` tokens a round with it inside ssm-spec's decode loop
(:class:`ssm_spec.hf.loop.mtp.MTPDrafter`).
"""

from .head import LAYER_COUNT_NAMES, MTPHead, config_layer_count, declared_layer_count, mtp_layer_count, text_decoder
from .load import checkpoint_path, load_mtp_head, mtp_tensor_files

__all__ = ["MTPHead", "load_mtp_head", "mtp_layer_count", "config_layer_count", "declared_layer_count", "text_decoder",
           "checkpoint_path", "mtp_tensor_files", "LAYER_COUNT_NAMES"]
