"""The draft options of a converted model's ``generate`` call, checked before anything runs:
transformers' names (``prompt_lookup_num_tokens``, ``assistant_model``, ``num_assistant_tokens``,
``use_mtp``), one drafter per call."""

from __future__ import annotations

import numbers

__all__ = ["check_draft_options"]


def _count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"generate: {name}={value!r}; expected an int >= 1")


def check_draft_options(named: dict, setting) -> None:
    """Refuse draft options a call cannot mean as given.

    Args:
        named: the call's arguments (``assistant_model`` among them).
        setting: ``setting(name, default)``, a generation setting resolved as transformers
            resolves it (the keyword, else the passed generation config, else the model's).

    Raises:
        ValueError: ``prompt_lookup_num_tokens`` or ``num_assistant_tokens`` set to anything but
            an integer >= 1 (``0`` would mean no drafts, ``2.5`` two);
            ``assistant_model`` with ``prompt_lookup_num_tokens`` (transformers' loop would
            silently ignore the assistant and draft by prompt lookup). ``use_mtp`` with another
            drafter is refused by :func:`~ssm_spec.hf.mtp.calls.check_mtp_call`.
    """
    for name in ("prompt_lookup_num_tokens", "num_assistant_tokens"):
        value = setting(name, None)
        if value is not None:
            _count(name, value)
    if named.get("assistant_model") is not None and setting("prompt_lookup_num_tokens", None) is not None:
        raise ValueError("generate: assistant_model and prompt_lookup_num_tokens: one drafter per call (an assistant, "
                         "prompt lookup or the MTP head)")
