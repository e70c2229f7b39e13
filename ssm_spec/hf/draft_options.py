"""The draft options of a converted model's ``generate`` call: transformers' names
(``prompt_lookup_num_tokens``, ``assistant_model``, ``num_assistant_tokens``, ``use_mtp``),
checked before anything runs (one drafter per call), the prompt's attention mask, and the draft
length a call may roll back."""

from __future__ import annotations

import numbers

import torch

from .config import DEFAULT_NUM_ASSISTANT_TOKENS

__all__ = ["check_attention_mask", "check_draft_options", "check_fallback", "draft_length"]


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
            silently ignore the assistant and draft by prompt lookup); an ``assistant_model``
            that is not a model; ``assistant_early_exit`` (drafting with the model's own first
            layers: neither loop runs it on a converted model). ``use_mtp`` with another
            drafter is refused by :func:`~ssm_spec.hf.mtp.calls.check_mtp_call`.
    """
    assistant = named.get("assistant_model")
    if assistant is not None and not isinstance(assistant, torch.nn.Module):
        raise ValueError(f"generate: assistant_model is a {type(assistant).__name__}; expected a loaded causal LM "
                         "(a torch.nn.Module such as AutoModelForCausalLM.from_pretrained(path))")
    if setting("assistant_early_exit", None) is not None:
        raise ValueError("generate: assistant_early_exit is not supported on a converted model; draft with "
                         "prompt_lookup_num_tokens, an assistant_model or use_mtp=True")
    for name in ("prompt_lookup_num_tokens", "num_assistant_tokens"):
        value = setting(name, None)
        if value is not None:
            _count(name, value)
    use_mtp = setting("use_mtp", None)
    if use_mtp is not None and not isinstance(use_mtp, bool):
        raise ValueError(f"generate: use_mtp={use_mtp!r}; expected True or False")
    if assistant is not None and setting("prompt_lookup_num_tokens", None) is not None:
        raise ValueError("generate: assistant_model and prompt_lookup_num_tokens: one drafter per call (an assistant, "
                         "prompt lookup or the MTP head)")


def check_attention_mask(named: dict) -> None:
    """Refuse an ``attention_mask`` a converted model would misread (either loop: the decode
    loop reads each row's left padding from it, transformers' from its sums).

    Args:
        named: the call's arguments: ``attention_mask`` beside ``inputs`` / ``input_ids``, the
            ``[B, P]`` token ids.

    Raises:
        ValueError: a mask that is not a tensor of the prompt's shape (transformers passes a
            ``[1, P]`` mask for two rows on, or fails inside a forward on another length), holds
            values other than 0 and 1, or has a row of no tokens.
    """
    mask = named.get("attention_mask")
    prompt = named.get("inputs") if named.get("inputs") is not None else named.get("input_ids")
    if mask is None or not isinstance(prompt, torch.Tensor):
        return
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(prompt.shape):
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__}"
        raise ValueError(f"generate: attention_mask is {shape}; expected the prompt's shape {list(prompt.shape)}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("generate: attention_mask holds values other than 0 and 1")
    empty = (mask == 0).all(-1).reshape(-1)
    if bool(empty.any()):
        raise ValueError(f"generate: attention_mask row {int(empty.nonzero()[0])} has no tokens (all zeros)")


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
        padding = "padding" in reason or "attention mask" in reason  # what the loop refuses of a mask
        raise ValueError(f"generate: {reason}: ssm-spec's decode loop does not implement it, and transformers' "
                         f"loop, which would run it, drafts for one row only ({rows} rows here): "
                         + ("left-pad the rows" if padding else "leave that out") + ", or call once per row")


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
        # prompt lookup copies its candidates from the sequence, so it never proposes more tokens
        # than the call's longest sequence (transformers 5.25 proposes past the token budget)
        k = int(get("prompt_lookup_num_tokens"))
        prompt = kwargs.get("inputs") if kwargs.get("inputs") is not None else kwargs.get("input_ids")
        longest, new = get("max_length"), get("max_new_tokens")
        if isinstance(prompt, torch.Tensor) and new is not None:
            longest = prompt.shape[-1] + int(new)
        return min(k, int(longest)) if longest else k
    if assistant is not None:
        cfg = assistant.generation_config
        k = int(getattr(cfg, "num_assistant_tokens", None) or DEFAULT_NUM_ASSISTANT_TOKENS)
        if getattr(cfg, "num_assistant_tokens_schedule", "constant") != "constant":
            # the heuristic schedules grow the draft after fully accepted rounds, up to the budget
            k = max(k, int(get("max_new_tokens") or get("max_length") or 0))
        return k
    return 0
