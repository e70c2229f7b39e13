"""The draft options of a converted model's ``generate`` call: transformers' names
(``prompt_lookup_num_tokens``, ``assistant_model``, ``num_assistant_tokens``, ``use_mtp``),
checked before anything runs (one drafter per call), and the draft length a call may roll back."""

from __future__ import annotations

import numbers

import torch

from .config import DEFAULT_NUM_ASSISTANT_TOKENS

__all__ = ["check_draft_options", "check_fallback", "draft_length"]


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
            an integer >= 1 (``0`` would mean no drafts, ``2.5`` two); ``use_mtp`` set to
            anything but a bool (``"no"`` would read as true);
            ``assistant_model`` with ``prompt_lookup_num_tokens`` (transformers' loop would
            silently ignore the assistant and draft by prompt lookup). ``use_mtp`` with another
            drafter is refused by :func:`~ssm_spec.hf.mtp.calls.check_mtp_call`.
    """
    for name in ("prompt_lookup_num_tokens", "num_assistant_tokens"):
        value = setting(name, None)
        if value is not None:
            _count(name, value)
    use_mtp = setting("use_mtp", None)
    if use_mtp is not None and not isinstance(use_mtp, bool):
        raise ValueError(f"generate: use_mtp={use_mtp!r}; expected True or False")
    if named.get("assistant_model") is not None and setting("prompt_lookup_num_tokens", None) is not None:
        raise ValueError("generate: assistant_model and prompt_lookup_num_tokens: one drafter per call (an assistant, "
                         "prompt lookup or the MTP head)")


def check_fallback(reason: str, prompt, named: dict, generation_config, setting) -> None:
    """A call the decode loop hands to transformers' loop (``reason``: the option it does not
    implement; ``prompt``: the call's ``[B, P]`` token ids, or ``None``): refuse it where that loop would end in transformers' assisted path (greedy or
    sampling with drafts) on more than one row, which it cannot draft for; beams ignore the
    drafts there and a ``custom_generate`` is the caller's own loop, so those run.

    Raises:
        ValueError: naming ``reason`` and the row count.
    """
    rows = prompt.shape[0] if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 else 1
    assisted = (setting("num_beams", 1) == 1 and reason != "custom_generate="
                and draft_length(generation_config, named) > 0)
    if rows > 1 and assisted:
        raise ValueError(f"generate: {reason}: ssm-spec's decode loop does not implement it, and transformers' "
                         f"loop, which would run it, drafts for one row only ({rows} rows here): left-pad the "
                         "rows, drop the option, or call once per row")


def draft_length(generation_config, kwargs) -> int:
    """The most tokens one ``generate`` call may need to roll back: the draft length.

    ``prompt_lookup_num_tokens``; or the assistant's ``num_assistant_tokens`` (with a heuristic
    schedule, which grows it, the generation budget); or, inside an assistant's own
    ``generate`` (``is_assistant``), its ``max_new_tokens`` plus the two tokens it re-feeds each
    round; 0 for plain decoding.
    """
    def get(name):
        value = kwargs.get(name)
        return getattr(generation_config, name, None) if value is None else value

    assistant = kwargs.get("assistant_model")
    if get("is_assistant"):
        return int(get("max_new_tokens") or 0) + 2
    if get("prompt_lookup_num_tokens"):
        return int(get("prompt_lookup_num_tokens"))
    if assistant is not None:
        cfg = assistant.generation_config
        k = int(getattr(cfg, "num_assistant_tokens", None) or DEFAULT_NUM_ASSISTANT_TOKENS)
        if getattr(cfg, "num_assistant_tokens_schedule", "constant") != "constant":
            # the heuristic schedules grow the draft after fully accepted rounds, up to the budget
            k = max(k, int(get("max_new_tokens") or get("max_length") or 0))
        return k
    return 0
