"""How a converted model's ``apply_recoverssm(mtp=...)`` and ``generate(use_mtp=True)`` reach the
MTP head: read it before anything changes, load it from the model's own checkpoint on first use,
and refuse calls the MTP drafter cannot serve (docs/design.md section 7.8)."""

from __future__ import annotations

from .load import load_mtp_head

__all__ = ["load_head_for_apply", "mtp_head", "check_mtp_call"]


def load_head_for_apply(model, mtp):
    """The head ``apply_recoverssm(model, mtp=...)`` asks for: a path or ``True`` (the model's own
    checkpoint) loads it now; ``None`` / ``False`` give ``None``.

    Raises:
        ValueError: as :func:`~ssm_spec.hf.mtp.load_mtp_head`, prefixed ``apply_recoverssm: mtp:``.
    """
    if mtp is None or mtp is False:
        return None
    try:
        return load_mtp_head(model, None if mtp is True else mtp)
    except ValueError as exc:
        raise ValueError(f"apply_recoverssm: mtp: {exc}") from None


def mtp_head(model):
    """The converted model's MTP head, read from the checkpoint it was loaded from on first use
    and kept (``model._recoverssm.mtp``).

    Raises:
        ValueError: as :func:`~ssm_spec.hf.mtp.load_mtp_head` (nothing is kept then).
    """
    runtime = model._recoverssm
    if runtime.mtp is None:
        runtime.mtp = load_mtp_head(model)
    return runtime.mtp


def check_mtp_call(model, named: dict, setting) -> None:
    """A ``generate(use_mtp=True)`` call: one drafter, the decode loop on, and the MTP head loaded
    (from the model's own checkpoint on first use). ``named``: the call's arguments;
    ``setting(name, default)``: a generation setting resolved as transformers does.

    Raises:
        ValueError: ``assistant_model`` or ``prompt_lookup_num_tokens`` too;
            ``decode_loop=False``; no head to load (:func:`mtp_head`).
    """
    other = [name for name in ("assistant_model", "prompt_lookup_num_tokens")
             if (named.get(name) if name == "assistant_model" else setting(name, None)) is not None]
    if other:
        raise ValueError(f"generate: use_mtp=True and {' and '.join(other)}: one drafter per call (the MTP head, "
                         "an assistant or prompt lookup)")
    if not model._recoverssm.config.decode_loop:
        raise ValueError("generate: use_mtp=True drafts inside ssm-spec's decode loop, which "
                         "apply_recoverssm(model, decode_loop=False) turned off (transformers' loop has no MTP drafter "
                         "for Qwen3-Next / Qwen3.5)")
    try:
        mtp_head(model)
    except ValueError as exc:
        raise ValueError(f"generate: use_mtp=True: {exc}") from None
