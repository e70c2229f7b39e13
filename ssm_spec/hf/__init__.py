"""Hugging Face integration: speculative decoding on Qwen3-Next / Qwen3.5 through ``generate``.

``apply_recoverssm(model)`` converts the model in place; ``generate(prompt_lookup_num_tokens=k)``,
``generate(assistant_model=draft)`` and ``generate(use_mtp=True)`` (the checkpoint's own MTP
head, :mod:`ssm_spec.hf.mtp`) then roll the linear-attention layers back exactly
(docs/design.md section 7). Needs the ``hf`` extra (transformers).
"""

from .._lazy import command_line, lazy_attributes

if command_line():  # the command parses its options first (cli_args): each name loads on first use
    __getattr__ = lazy_attributes(__name__, {
        "AcceptanceStats": "cache", "ByteTokenizer": "tiny", "MTPHead": "mtp", "RecoverGDNAdapter": "adapter",
        "RecoverLinearAttentionLayer": "cache", "RecoverSSMCache": "cache", "RecoverSSMConfig": "config",
        "RollbackPool": "rollback", "acceptance_stats": "config", "apply_recoverssm": "apply",
        "cache_kwarg": "apply", "is_converted": "apply", "kept_cache": "config", "load_mtp_head": "mtp",
        "recoverssm_config": "config", "tiny_config": "tiny", "tiny_model": "tiny"})
else:
    from .adapter import RecoverGDNAdapter
    from .apply import apply_recoverssm, cache_kwarg, is_converted
    from .cache import AcceptanceStats, RecoverLinearAttentionLayer, RecoverSSMCache
    from .config import RecoverSSMConfig, acceptance_stats, kept_cache, recoverssm_config
    from .mtp import MTPHead, load_mtp_head
    from .rollback import RollbackPool
    from .tiny import ByteTokenizer, tiny_config, tiny_model

__all__ = [
    "AcceptanceStats",
    "ByteTokenizer",
    "MTPHead",
    "RecoverGDNAdapter",
    "RecoverLinearAttentionLayer",
    "RecoverSSMCache",
    "RecoverSSMConfig",
    "RollbackPool",
    "acceptance_stats",
    "apply_recoverssm",
    "cache_kwarg",
    "is_converted",
    "kept_cache",
    "load_mtp_head",
    "recoverssm_config",
    "tiny_config",
    "tiny_model",
]
