"""ssm-spec's own decode loop for ``generate`` on a converted model (docs/design.md section 7.7).

transformers prepares the call as usual (generation config, special tokens, lengths, logits
processors, stopping criteria) and hands it to :func:`loop_generate` through its
``custom_generate`` hook; the loop then runs plain decoding, prompt lookup, an assistant's
drafts or the checkpoint's MTP head's (``use_mtp=True``) for any batch size, every round on the
device (:mod:`.runner`). A call the loop does not cover (:func:`blocker`, or a processor found
at run time) goes to transformers' own loop with one warning that names the option.
"""

from __future__ import annotations

import functools
import math

import torch

from .accept import Scoring, unsupported_processor
from .assistant import AssistantDrafter
from .lookup import PromptLookup
from .mtp import MTPDrafter
from .runner import DecodeLoop, prompt_width

__all__ = ["ASSISTANT_CALL", "LoopFallback", "blocker", "loop_generate", "custom_generate_for", "bucket_for", "CAPACITY_ROUND",
           "DecodeLoop", "PromptLookup", "AssistantDrafter", "MTPDrafter", "Scoring", "draft_tokens",
           "LOOP_NUM_ASSISTANT_TOKENS"]

#: Buffers hold a multiple of this many token columns, so calls of similar lengths share graphs.
CAPACITY_ROUND = 256
#: Stopping criteria the loop applies itself (a budget and end-of-sequence tokens).
STOPPING = ("MaxLengthCriteria", "EosTokenCriteria")
#: Generation-config settings that only transformers' loop implements, with the value that means "off".
OFF = {"num_beams": 1, "output_scores": False, "output_logits": False, "output_attentions": False,
       "output_hidden_states": False, "max_time": None, "stop_strings": None, "dola_layers": None,
       "penalty_alpha": None, "guidance_scale": None, "watermarking_config": None, "token_healing": False,
       "cache_implementation": None, "low_memory": None}
#: ``generate`` arguments that only transformers' loop implements.
ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "negative_prompt_ids",
             "synced_gpus", "tokenizer", "assistant_tokenizer", "inputs_embeds")


#: :func:`blocker`'s reason for a call transformers' assisted loop makes to its assistant (no warning).
ASSISTANT_CALL = "a call drafting for another model"


class LoopFallback(Exception):
    """Raised inside the loop before anything runs: the call needs transformers' own loop."""


def bucket_for(batch: int) -> int:
    """The batch bucket of ``batch`` rows: the next power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch))))


def blocker(model, named: dict, setting) -> str | None:
    """Why this ``generate`` call cannot run in the decode loop, in words that name the option;
    ``None`` when it can. ``setting(name, default)`` resolves a generation setting as
    transformers does (argument, passed config, model config)."""
    if setting("is_assistant", False):
        return ASSISTANT_CALL
    for name in ARGUMENTS:
        value = named.get(name)
        if value is not None and not (name == "synced_gpus" and value is False) and not (
                name in ("logits_processor", "stopping_criteria") and len(value) == 0):
            return f"{name}="
    for name, off in OFF.items():
        value = setting(name, off)
        if value != off and value is not None and not (off is None and value in (False, 0)):
            return f"{name}={value!r}"
    if not setting("use_cache", True):
        return "use_cache=False"
    if named.get("cache") is not None or named.get("past_key_values") is not None:
        return "a cache passed to generate (it runs on that cache)"
    prompt = named.get("inputs") if named.get("inputs") is not None else named.get("input_ids")
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        return "a prompt that is not a [batch, tokens] tensor of token ids"
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    from .forward import SUPPORTED_ATTENTION

    if impl not in SUPPORTED_ATTENTION:
        return f"attention implementation {impl!r}"
    from ..placement import placement_problem

    problem = placement_problem(model)
    if problem is not None:
        return problem
    if any(getattr(m, "tp_group", None) is not None for m in model.modules()):
        return "tensor parallelism (tp_group)"
    assistant = named.get("assistant_model")
    if assistant is not None:
        if assistant.config.get_text_config().vocab_size != model.config.get_text_config().vocab_size:
            return "an assistant with another vocabulary"
        text = assistant.config.get_text_config()
        if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) is not False \
                and "sliding_attention" in (getattr(text, "layer_types", None) or ["sliding_attention"]):
            return "an assistant with sliding-window attention"
        impl = getattr(assistant.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            return f"an assistant with attention implementation {impl!r}"
    return None


def custom_generate_for(assistant, streamer, mtp: bool = False):
    """The callable ``generate(custom_generate=...)`` takes, with the call's assistant,
    streamer and ``use_mtp`` bound (transformers passes a callable none of them)."""
    return functools.partial(loop_generate, ssm_assistant=assistant, ssm_streamer=streamer, ssm_mtp=mtp)


#: The decode loop's draft length for an assistant or the MTP head when ``num_assistant_tokens``
#: is left at transformers' default (20): transformers' loop shortens its drafts round by round
#: (heuristic schedule, confidence threshold), the loop drafts a fixed ``k`` (fixed shapes), and
#: 20 drafts a round cost a verify of 21 tokens and an assistant ``k (k + 3) / 2`` token forwards.
LOOP_NUM_ASSISTANT_TOKENS = 4


def draft_tokens(generation_config) -> int:
    """``k`` of an assistant's or the MTP head's drafts in the decode loop: the config's
    ``num_assistant_tokens``, or :data:`LOOP_NUM_ASSISTANT_TOKENS` where it is unset or
    transformers' default.

    Raises:
        ValueError: ``num_assistant_tokens`` below 1.
    """
    from ..config import DEFAULT_NUM_ASSISTANT_TOKENS

    value = getattr(generation_config, "num_assistant_tokens", None)
    if value is None or value == DEFAULT_NUM_ASSISTANT_TOKENS:
        return LOOP_NUM_ASSISTANT_TOKENS
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"generate: num_assistant_tokens={value!r}; expected an int >= 1")
    return int(value)


def _prompt_padding(input_ids: torch.Tensor, attention_mask) -> torch.Tensor:
    """Each row's left padding ``[B]`` from the call's ``attention_mask`` (``None``: none; its
    shape and values were checked by :func:`~ssm_spec.hf.draft_options.check_attention_mask`).

    Raises:
        LoopFallback: right padding or gaps (transformers' loop runs those).
    """
    if attention_mask is None:
        return torch.zeros(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
    mask = attention_mask.to(torch.bool)
    if bool((~mask[:, -1]).any()):
        raise LoopFallback("right padding in the attention mask")
    pad = (~mask).sum(-1)
    if bool((mask.cumsum(-1) != (torch.arange(mask.shape[1], device=mask.device)[None, :] - pad[:, None] + 1)
             .clamp_min(0)).any()):
        raise LoopFallback("an attention mask with gaps (not left padding)")
    return pad.to(torch.int64)


def _budgets(processors, stopping, prompt_len: int) -> tuple[int, int, int]:
    """``(max_new, min_new, min_length)`` from transformers' prepared criteria and processors."""
    max_length = None
    for c in stopping:
        name = type(c).__name__
        if name not in STOPPING:
            raise LoopFallback(f"stopping criterion {name}")
        if name == "MaxLengthCriteria":
            max_length = c.max_length if max_length is None else min(max_length, c.max_length)
    if max_length is None:
        raise LoopFallback("no max_length / max_new_tokens")
    min_new = min_length = 0
    for p in processors:
        if type(p).__name__ == "MinNewTokensLengthLogitsProcessor":
            min_new = max(min_new, int(p.min_new_tokens) + int(p.prompt_length_to_skip) - prompt_len)
        elif type(p).__name__ == "MinLengthLogitsProcessor":
            min_length = max(min_length, int(p.min_length))
    return max(0, max_length - prompt_len), min_new, min_length


def _eos(generation_config, device) -> torch.Tensor:
    eos = getattr(generation_config, "_eos_token_tensor", None)
    if eos is None:
        eos = generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        eos = torch.tensor(eos, dtype=torch.int64)
    return eos.reshape(-1).to(device=device, dtype=torch.int64)


def call_draft_tokens(generation_config, assistant, mtp: bool, max_new: int) -> int:
    """The call's draft length ``k``: the MTP head's or an assistant's :func:`draft_tokens`, or
    ``prompt_lookup_num_tokens``; 0 without a drafter. At most ``max_new`` (at least 1): drafts
    past the call's token budget are never kept, and each costs verify columns and buffer rows
    (``prompt_lookup_num_tokens=100000`` would ask for gigabytes for a five-token call)."""
    if mtp:
        k = draft_tokens(generation_config)
    elif getattr(generation_config, "prompt_lookup_num_tokens", None):
        k = int(generation_config.prompt_lookup_num_tokens)
    elif assistant is not None:
        k = draft_tokens(assistant.generation_config)
    else:
        return 0
    return min(k, max(1, max_new))


def _drafter(model, assistant, generation_config, eos, bucket, capacity, scoring, sampling, k: int, head=None):
    from ..config import recoverssm_config
    from ..config import is_converted

    compiles = recoverssm_config(model).compiles_on(model.get_input_embeddings().weight.device)
    if head is not None:
        return MTPDrafter(model, head, k, bucket, capacity, scoring, sampling, compile=compiles)
    if getattr(generation_config, "prompt_lookup_num_tokens", None):
        return PromptLookup(k, getattr(generation_config, "max_matching_ngram_size", None), eos, compile=compiles)
    if assistant is None:
        return None
    config = recoverssm_config(assistant) if is_converted(assistant) else None
    # a converted assistant's forwards compile as its own setting says, and under "auto" (the
    # default of apply_recoverssm, which an assistant converted without options has) as the
    # target's loop does: its steps run inside the target's captured round, not with graphs of
    # their own
    kw = {} if config is None else dict(state_dtype=config.state_dtype, mode=config.mode,
                                        compile=compiles if config.compile == "auto" else config.compile)
    return AssistantDrafter(assistant, k, bucket, capacity, scoring, sampling, **kw)


def loop_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                  ssm_assistant=None, ssm_streamer=None, ssm_mtp=False, **model_kwargs):
    """``generate``'s decoding step on a converted model, as transformers' ``custom_generate``
    calls it after preparing the call. Returns ``sequences [B, P + new]`` (or
    ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``). ``ssm_mtp`` (or
    ``generation_config.use_mtp``): draft with the MTP head the converted model holds
    (``model._recoverssm.mtp``, loaded by the converted ``generate``), ``num_assistant_tokens``
    a round.

    Raises:
        LoopFallback: the prepared call has a processor or stopping criterion the loop does
            not implement (raised before anything runs; the converted ``generate`` then runs
            transformers' loop).
        ValueError: an empty prompt; MTP drafts asked for and no head loaded.
    """
    from ..config import is_converted, recoverssm_config

    processors = list(logits_processor or [])
    name = unsupported_processor(processors)
    if name is not None:
        raise LoopFallback(f"logits processor {name}")
    B, P = input_ids.shape
    if P == 0:
        raise ValueError("generate: the prompt has no tokens; give at least one (a BOS token, say)")
    max_new, min_new, min_length = _budgets(processors, list(stopping_criteria or []), P)
    pad = _prompt_padding(input_ids, model_kwargs.get("attention_mask"))
    device = model.get_input_embeddings().weight.device
    eos = _eos(generation_config, device)
    sampling = bool(generation_config.do_sample)
    pad_id = generation_config.pad_token_id
    pad_id = int(pad_id) if pad_id is not None else (int(eos[0]) if eos.numel() else 0)
    config = recoverssm_config(model)
    runtime = model._recoverssm
    bucket = bucket_for(B)
    head = None
    if ssm_mtp or getattr(generation_config, "use_mtp", None):
        if runtime.mtp is None:
            raise ValueError("generate: use_mtp=True but the model holds no MTP head (apply_recoverssm(model, mtp=PATH) "
                             "loads one; the converted generate loads the checkpoint's own)")
        head = runtime.placed_mtp(device, model.get_input_embeddings().weight.dtype)
    k = call_draft_tokens(generation_config, ssm_assistant, head is not None, max_new)
    need = prompt_width(P, bool(config.cuda_graphs) and device.type == "cuda") + max_new + k + 2
    capacity = -(-need // CAPACITY_ROUND) * CAPACITY_ROUND
    scoring = Scoring(processors, eos)
    weight = model.get_input_embeddings().weight
    key_base = (bucket, scoring.key(), sampling, tuple(eos.tolist()), pad_id, config, weight.dtype,
                torch.is_inference_mode_enabled(), tuple(p.data_ptr() for p in model.parameters()),
                None if ssm_assistant is None else tuple(p.data_ptr() for p in ssm_assistant.parameters()),
                recoverssm_config(ssm_assistant) if ssm_assistant is not None and is_converted(ssm_assistant) else None,
                bool(getattr(generation_config, "prompt_lookup_num_tokens", None)),
                getattr(generation_config, "max_matching_ngram_size", None),
                None if head is None else ("mtp", id(head), tuple(p.data_ptr() for p in head.parameters())),
                k)  # the drafter's draft length, whichever drafter it is (call_draft_tokens)
    loop = runtime.loop
    if loop is None or runtime.loop_key != key_base or loop.rows.capacity < need:
        loop = None
        runtime.drop_loop()  # its buffers freed before the new loop's are made
        drafter = _drafter(model, ssm_assistant, generation_config, eos, bucket, capacity, scoring, sampling, k, head)
        loop = DecodeLoop(model, bucket, capacity, drafter, scoring, sampling, eos, pad_id, graphs=config.cuda_graphs,
                          state_dtype=config.state_dtype, mode=config.mode, compile=config.compiles_on(device))
        runtime.loop, runtime.loop_key = loop, key_base
    if ssm_streamer is not None:
        ssm_streamer.put(input_ids.cpu())
    sequences, stats = loop.run(input_ids.to(device), pad.to(device), max_new, min_new, min_length, ssm_streamer)
    if ssm_streamer is not None:
        ssm_streamer.end()
    runtime.last_stats = stats
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
