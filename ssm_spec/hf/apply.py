"""``apply_recoverssm``: convert a Qwen3-Next / Qwen3.5 causal LM in place (in the style of
Liger-Kernel's ``apply_liger_kernel_to_*``), so that ``generate`` can run assisted decoding and
prompt lookup on it exactly (docs/design.md section 7)."""

from __future__ import annotations

import functools
import inspect
import types
import warnings

import torch
from torch import nn

from .adapter import RecoverGDNAdapter
from .cache import RecoverSSMCache
from .config import RecoverSSMConfig, RecoverSSMRuntime, cache_kwarg, is_converted
from .experts import capture_safe_experts
from .fused_linear import fuse_shared_input_linears, unfuse_shared_input_linears
from .narrow_gemv import drop_narrow_gemv, use_narrow_gemv
from .graphed import SUPPORTED_ATTENTION
from .draft_options import check_attention_mask, check_draft_options, check_fallback, draft_length
from .mtp.calls import check_mtp_call, load_head_for_apply
from .placement import carry_hook, placement_problem

__all__ = ["apply_recoverssm", "is_converted", "draft_length", "cache_kwarg"]



def _is_hf_gdn(module: nn.Module) -> bool:
    return hasattr(module, "A_log") and (hasattr(module, "in_proj_qkvz") or hasattr(module, "in_proj_qkv"))


def has_unconverted_gdn(model: nn.Module) -> bool:
    """Whether ``model`` holds a Hugging Face GatedDeltaNet that :func:`apply_recoverssm` has not
    replaced (read from the module tree: transformers 5.25 dropped the ``_is_stateful`` flag that
    older releases set on such models)."""
    return any(_is_hf_gdn(m) and not isinstance(m, RecoverGDNAdapter) for m in model.modules())


def apply_recoverssm(model: nn.Module, *, state_dtype: torch.dtype | None = None,
                     cuda_graphs: bool | None = None, mode: str | None = None, decode_loop: bool | None = None,
                     compile: bool | str | None = None, fused_projections: bool | None = None, tp_group=None,
                     mtp=None) -> nn.Module:
    """Convert a Qwen3-Next, Qwen3.5 or Qwen3.5-MoE model in place and return it.

    Every Hugging Face GatedDeltaNet (``linear_attn`` of a decoder layer) is replaced by a
    :class:`~ssm_spec.hf.adapter.RecoverGDNAdapter` (a :class:`~ssm_spec.RecoverGatedDeltaNet`
    built by ``from_hf``: the HF submodules and parameters are shared, not copied, under their
    own names, so ``state_dict`` keys and ``save_pretrained`` are unchanged). ``generate`` and
    ``forward`` then create a :class:`~ssm_spec.hf.RecoverSSMCache` when none is passed, sized
    for the draft length of the call, so ``generate(prompt_lookup_num_tokens=k)``,
    ``generate(assistant_model=draft)`` and a converted model as an assistant work, and with
    greedy fp32 decoding give exactly plain ``generate``'s tokens. Attention layers keep
    transformers' KV cache. Calling it again only updates ``state_dtype``, ``cuda_graphs`` and
    ``mode`` (when given).

    Args:
        model: a ``Qwen3NextForCausalLM`` (dense or expert MLPs), ``Qwen3_5ForCausalLM``,
            ``Qwen3_5MoeForCausalLM``, ``Qwen3_5ForConditionalGeneration`` or
            ``Qwen3_5MoeForConditionalGeneration`` (text prompts; the vision tower is left alone
            and ``generate`` refuses image and video inputs), or any
            module tree holding their GatedDeltaNet layers as ``linear_attn``, on any device
            and dtype, or spread over devices by a ``device_map`` (``from_pretrained(...,
            device_map=...)`` or ``accelerate.dispatch_model``; GPUs, the CPU, weights
            offloaded to the CPU or the disk): each converted layer keeps the accelerate hook
            of the layer it replaces and its states live on the device its forward runs on
            (docs/design.md section 5.9). The expert layers run through transformers' own
            implementation.
        state_dtype: recurrent state dtype of the caches it creates: ``torch.float32`` (the
            default) or ``torch.bfloat16``.
        cuda_graphs: ``True``: ``generate`` on unpadded rows uses a cache with static
            attention buffers (``RecoverSSMCache(max_cache_len=...)``, sized for the call) and
            replays every forward after the prompt from a CUDA graph captured on its first use
            (:mod:`ssm_spec.hf.graphed`; off CUDA the same forward runs eagerly). The cache
            and its graphs are kept on the model and reused by the next ``generate`` call that
            fits them (same batch size, dtype, device, parameters and inference mode, enough
            tokens; a cache returned by an earlier call is reset then). Padded batches,
            ``use_cache=False`` and an assistant's own calls (the model drafting for another,
            or for itself) get the plain cache; a cache passed in is used as it is (one made
            with ``max_cache_len`` runs graphed). ``False`` also drops the kept cache.
            ``None`` keeps the current setting (initially off). A model spread over several
            devices, or with offloaded weights (a device map), is not captured: ``generate``
            warns (``RuntimeWarning``) and runs eagerly with the plain cache (a graphed cache
            passed in runs eagerly too), with the same tokens.
        mode: ``"exact"`` (the default: tokens equal plain greedy in fp32) or ``"fast"``: the
            closed-form verify (docs/design.md section 2.6; equal tokens up to the first near-tie).
            ``None`` keeps the current setting.
        decode_loop: ``True`` (the default): ``generate`` runs ssm-spec's decode loop
            (:mod:`ssm_spec.hf.loop`: plain decoding, prompt lookup and assistants, any batch
            size, rounds on the device and, with ``cuda_graphs`` on CUDA, captured); a call with
            an option the loop does not implement (beams, custom logits processors,
            ``output_scores``, a cache passed in, ...) runs transformers' loop after one
            ``RuntimeWarning`` naming the option (with drafts on several rows, which that loop
            cannot draft for, a ``ValueError`` instead). ``False``: always transformers' loop
            (with the converted cache). ``None`` keeps the current setting.
        compile: ``True``: the decode loop's verify forwards, the MTP head's in-round steps
            and the round's integer bookkeeping run through ``torch.compile(fullgraph=True,
            dynamic=False)`` (inductor; one static graph per bucket and window width, compiled
            on its first call: on an H200 at 3.6 B parameters about 90 s for a first plain call,
            its capture included, and 35-50 s for each draft width); ``False`` runs them eagerly;
            ``"auto"`` (the default) compiles when the loop captures CUDA graphs
            (``cuda_graphs=True`` on a CUDA device), and on an assistant when the target loop
            it drafts for compiles (one graph per draft width of its own). ``None`` keeps the
            current setting.
        fused_projections: ``True`` (the default): sibling linears that read the same input
            run as one GEMM (:func:`~ssm_spec.hf.fused_linear.fuse_shared_input_linears`:
            GDN's input projections, attention's q/k/v, every MLP's gate/up, the shared
            expert's; the parameters become views of one concatenated weight, keeping their
            names and values, so ``state_dict`` and ``save_pretrained`` are unchanged); and
            the projections back to the residual stream run, in a compiled one-row bf16/fp16
            forward on CUDA, as inductor's GEMV (:mod:`~ssm_spec.hf.narrow_gemv`: same
            parameters; cuBLAS everywhere else). ``False`` gives each its own weight and
            ``nn.Linear`` again. ``None`` keeps the current setting.
        tp_group: a ``torch.distributed`` process group (first conversion only): every GDN
            layer keeps this rank's share of its heads (copies of its slices of the full
            layer's weights; ``RecoverGatedDeltaNet.shard_``), its states hold only those, and
            its output is all-reduced over the group. Everything else (embeddings, attention,
            MLPs, the LM head) is left as it is: replicated, or sharded by the model's own
            tensor parallelism. Every rank must run the same ``generate`` call. Do not
            ``save_pretrained`` a sharded model (its GDN weights are this rank's slices).
        mtp: the checkpoint's multi-token-prediction head for ``generate(use_mtp=True,
            num_assistant_tokens=k)`` (docs/design.md section 7.8): a path (a checkpoint
            directory with ``model.safetensors`` or ``model.safetensors.index.json``, an index
            file or a ``.safetensors`` file) to read the ``mtp.*`` tensors from now; ``True``:
            read them now from the checkpoint the model was loaded from; ``False``: drop a
            loaded head; ``None`` (the default) keeps the current one (without one,
            ``generate(use_mtp=True)`` reads the model's own checkpoint on its first call). The
            head is read and checked before anything else changes: on a ``ValueError`` the
            model is as it was (not converted, if this was the first call; its earlier head
            kept). See :func:`ssm_spec.hf.mtp.load_mtp_head`.

    Raises:
        ValueError: ``model`` not a ``torch.nn.Module``; ``cuda_graphs``, ``decode_loop`` or
            ``fused_projections`` not a bool, ``compile`` not a bool or ``"auto"``; no
            GatedDeltaNet layer found; a layer ``from_hf`` rejects; another ``state_dtype``;
            ``cuda_graphs`` with an attention implementation other than sdpa or eager;
            ``tp_group`` with GDN weights offloaded by a device map (on the ``meta`` device:
            there is nothing to slice), or on a model already converted. The converted
            ``generate`` raises it for prompt lookup or an assistant when ``model.device`` is
            ``meta`` (the embeddings offloaded: transformers' assisted loop moves drafted tokens
            there); for draft options that are not ints >= 1 or name two drafters
            (:func:`~ssm_spec.hf.draft_options.check_draft_options`); for drafts on several rows
            with an option only transformers' loop runs. ``mtp``: no MTP layer count in the config (or 0), no
            checkpoint to read, no / missing / unexpected ``mtp.*`` tensors, shapes that do not
            fit the model (:func:`~ssm_spec.hf.mtp.load_mtp_head`).

    The converted layers are inference kernels: ``generate`` runs them under ``no_grad``; a
    ``forward`` in grad mode with trainable parameters raises ``ValueError``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_recoverssm: model: got a {type(model).__name__}; expected a transformers model "
                         "(a torch.nn.Module, e.g. from AutoModelForCausalLM.from_pretrained)")
    base = model._recoverssm.config if is_converted(model) else RecoverSSMConfig()
    try:
        config = base.replace(state_dtype=state_dtype, mode=mode, cuda_graphs=cuda_graphs, decode_loop=decode_loop,
                              compile=compile, fused_projections=fused_projections)
    except ValueError as exc:
        raise ValueError(str(exc).replace("RecoverSSMConfig:", "apply_recoverssm:", 1)) from None
    if cuda_graphs:
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(f"apply_recoverssm: cuda_graphs: attention implementation {impl!r}; supported: "
                             f"{SUPPORTED_ATTENTION} (load the model with attn_implementation='sdpa')")
    head = load_head_for_apply(model, mtp)  # before anything changes: a failed load leaves the model as it was
    if is_converted(model):
        if tp_group is not None:
            raise ValueError("apply_recoverssm: tp_group: this model is already converted (its GDN layers hold every "
                             "head); shard on the first conversion: apply_recoverssm(unconverted_model, tp_group=...)")
        if config != model._recoverssm.config:
            model._recoverssm.drop_loop()  # built for the old settings
        if config.fused_projections != model._recoverssm.config.fused_projections:
            model._recoverssm.kept.cache = None  # its graphs read the old weights
            (fuse_shared_input_linears if config.fused_projections else unfuse_shared_input_linears)(model)
            (use_narrow_gemv if config.fused_projections else drop_narrow_gemv)(model)
        model._recoverssm.config = config
        if mtp is not None:
            model._recoverssm.mtp = head
        if cuda_graphs is not None:
            capture_safe_experts(model, config.cuda_graphs)
            if not config.cuda_graphs:
                model._recoverssm.kept.cache = None
        return model
    found = [(parent, parent.linear_attn) for parent in model.modules()
             if isinstance(getattr(parent, "linear_attn", None), nn.Module) and _is_hf_gdn(parent.linear_attn)]
    if tp_group is not None and any(p.device.type == "meta" for _, child in found for p in child.parameters()):
        raise ValueError("apply_recoverssm: tp_group: GatedDeltaNet weights are offloaded by a device map (on the "
                         "meta device); shard a model whose GDN layers are resident")
    for parent, child in found:
        adapter = RecoverGDNAdapter.from_hf(child, tp_group=tp_group)
        carry_hook(child, adapter)  # a device map's hook: same execution device, same offloading
        parent.linear_attn = adapter
    if not found:
        raise ValueError(f"apply_recoverssm: {type(model).__name__} has no Qwen3-Next / Qwen3.5 GatedDeltaNet "
                         "layer (a `linear_attn` with A_log and in_proj_qkvz / in_proj_qkv)")
    if config.fused_projections:
        fuse_shared_input_linears(model)
        use_narrow_gemv(model)
    model._recoverssm = RecoverSSMRuntime(config, cache_kwarg(model), mtp=head)
    capture_safe_experts(model, config.cuda_graphs)
    model._is_stateful = False  # transformers' guard up to 5.24: our cache rolls the recurrent state back
    _bind(model, "generate", _generate)
    _bind(model, "forward", _forward)
    for decoder in _decoders(model):
        _bind(decoder, "forward", _decoder_forward)
    return model


def _decoders(model: nn.Module) -> list[nn.Module]:
    """The text decoders of ``model`` (a ``Qwen3NextModel`` / ``Qwen3_5TextModel``: the modules
    whose ``layers`` hold converted GDN layers), outermost first."""
    return [m for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)
            and any(isinstance(getattr(layer, "linear_attn", None), RecoverGDNAdapter) for layer in m.layers)]


def _decoder_forward(self, *args, **kwargs):
    """``forward`` of a converted model's text decoder: opens the forward on a
    :class:`RecoverSSMCache` it is given (``begin_forward``, with the rows and tokens of its
    ``input_ids`` / ``inputs_embeds``) unless the caller opened it already (the converted
    model's graphed path), runs the decoder, and closes what it opened."""
    original = type(self).forward
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if args or not isinstance(cache, RecoverSSMCache):
        named = inspect.signature(original).bind_partial(self, *args, **kwargs).arguments
        named = {**named, **named.get("kwargs", {})}
        cache = named.get("cache", named.get("past_key_values"))
    else:
        named = kwargs
    if not isinstance(cache, RecoverSSMCache) or cache.forward_open:
        return original(self, *args, **kwargs)
    if cache.graphed is not None:
        raise ValueError("RecoverSSMCache: a cache with max_cache_len serves the converted model's own forward "
                         "(its graphed path); do not pass it to the base model or a decoder layer directly")
    tokens = named.get("input_ids")
    tokens = named.get("inputs_embeds") if tokens is None else tokens
    cache.begin_forward(*tokens.shape[:2])
    try:
        return original(self, *args, **kwargs)
    finally:
        cache.end_forward()


#: ``generate`` inputs of the vision-language classes (``Qwen3_5[Moe]ForConditionalGeneration``) that a
#: converted model refuses: only text prompts are tested through its cache.
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")


def _generate(self, *args, **kwargs):
    """``generate`` of a converted model: creates or sizes its RecoverSSMCache, then runs
    transformers' own ``generate`` (looked up on the class, so copies of the model call theirs)."""
    original = type(self).generate
    named = inspect.signature(original).bind_partial(self, *args, **kwargs).arguments
    named = {**named, **named.get("kwargs", {})}
    gen_config = named.get("generation_config") or self.generation_config
    media = [name for name in MEDIA_INPUTS if named.get(name) is not None]
    if media:
        raise ValueError(f"generate: {', '.join(media)}: a converted model takes text prompts only (its GDN cache "
                         "does not track image or video tokens); call generate on the unconverted model for those")
    check_draft_options(named, lambda name, default: _setting(self, gen_config, named, name, default))
    check_attention_mask(named)
    passed = kwargs.get(self._recoverssm.cache_kwarg, kwargs.get("past_key_values", kwargs.get("cache")))
    if passed is not None and not isinstance(passed, RecoverSSMCache):  # before any fallback is announced
        raise ValueError(f"generate: got a {type(passed).__name__}; a converted model needs a RecoverSSMCache "
                         "(or none, and generate creates it)")
    if passed is not None and {id(a) for a in passed.adapters} != {
            id(m) for m in self.modules() if isinstance(m, RecoverGDNAdapter)}:
        raise ValueError("generate: the RecoverSSMCache passed was made for another model (its GDN layers are not "
                         "this model's); make one with RecoverSSMCache(model) for the model that generates")
    assistant = named.get("assistant_model")
    if assistant is not None and has_unconverted_gdn(assistant):
        raise ValueError("generate: the assistant has GatedDeltaNet layers that ssm_spec has not converted, so their "
                         "states cannot be rolled back exactly; convert it with ssm_spec.hf.apply_recoverssm(assistant) "
                         "first")
    use_mtp = bool(_setting(self, gen_config, named, "use_mtp", False))
    if use_mtp:
        check_mtp_call(self, named, lambda name, default: _setting(self, gen_config, named, name, default))
    if self._recoverssm.config.decode_loop:
        from .loop import ASSISTANT_CALL, LoopFallback, blocker, custom_generate_for

        reason = blocker(self, named, lambda name, default: _setting(self, gen_config, named, name, default))
        if reason is None and named.get("custom_generate") is not None:
            reason = "custom_generate="
        if reason is not None and use_mtp:
            raise ValueError(f"generate: use_mtp=True drafts inside ssm-spec's decode loop, and this call needs "
                             f"transformers' loop ({reason}), which has no MTP drafter for Qwen3-Next / Qwen3.5")
        if reason is None:
            call = {k: v for k, v in named.items()
                    if k not in ("self", "kwargs", "assistant_model", "streamer", "use_mtp")}
            try:
                return original(self, **call,
                                custom_generate=custom_generate_for(assistant, named.get("streamer"), use_mtp))
            except LoopFallback as exc:
                if use_mtp:
                    raise ValueError(f"generate: use_mtp=True drafts inside ssm-spec's decode loop, and this call "
                                     f"needs transformers' loop ({exc})") from None
                reason = str(exc)
        if reason != ASSISTANT_CALL:
            check_fallback(reason, _prompt(named), named, gen_config,
                           lambda name, default: _setting(self, gen_config, named, name, default))
            warnings.warn(f"generate: {reason}: this call runs transformers' own decoding loop (ssm-spec's decode "
                          "loop does not implement it)", RuntimeWarning, stacklevel=3)
    k = draft_length(gen_config, named)
    drafting = k > 0 and not _is_assistant_call(gen_config, named)  # this call verifies drafts
    if drafting and self.device.type == "meta":
        raise ValueError("generate: prompt lookup and assistants need model.device to hold data, and it is 'meta' "
                         "here (a device map offloads the model's first weights, e.g. model.embed_tokens, to 'cpu' "
                         "or 'disk'): transformers' assisted loop moves every drafted token there. Keep "
                         "model.embed_tokens on an execution device (not offloaded), or generate without drafts")
    R = max(1, k + 1)
    runtime = self._recoverssm
    config = runtime.config
    key = runtime.cache_kwarg
    cache = kwargs.get(key, kwargs.get("past_key_values", kwargs.get("cache")))
    if cache is None and not _setting(self, gen_config, named, "use_cache", True):
        return original(self, *args, **kwargs)  # every step re-feeds the sequence: no state to keep
    if cache is None:
        graphs = config.cuda_graphs and not _is_assistant_call(gen_config, named)
        if graphs:
            problem = placement_problem(self)
            if problem is not None:
                warnings.warn(f"apply_recoverssm(cuda_graphs=True): {problem}; a CUDA graph holds the forward of one "
                              "device with resident weights, so generate runs eagerly with the plain cache",
                              RuntimeWarning, stacklevel=3)
                graphs = False
        cache = _graph_cache(self, named, gen_config, R) if graphs else None
        if cache is None:
            cache = RecoverSSMCache(self, max_pending=R, state_dtype=config.state_dtype, mode=config.mode)
        kwargs[key] = cache
    elif isinstance(cache, RecoverSSMCache):
        cache.max_pending = max(cache.max_pending, R)
        need = _tokens_needed(self, named, gen_config, R)
        if cache.kv_capacity is not None and need is not None and cache.kv_capacity < need:
            raise ValueError(f"generate: the cache holds max_cache_len={cache.kv_capacity} tokens; this call may "
                             f"need {need} (prompt, new tokens and drafts)")
    prompt = _prompt(named)  # the first round's drafts are its tokens past the prompt's uncached part
    prompt = prompt if isinstance(prompt, torch.Tensor) else None
    if drafting and prompt is not None and prompt.shape[0] == 1 and cache.get_seq_length() > 0:
        # a follow-up turn with drafts on a reused cache: transformers' assisted loop feeds its first
        # forward the whole prompt whatever the cache holds (5.17-5.2x; the plain loop feeds only the
        # uncached tokens), so start the sequence again and let that forward re-read it (batch 1:
        # transformers refuses assisted generation on larger batches, and the cache stays as it is)
        cache.reset(keep_stats=True)
    cache.begin_generate(None if prompt is None else prompt.shape[-1] - cache.get_seq_length())
    runtime.last_stats = cache.stats
    return original(self, *args, **kwargs)


def _prompt(named):
    """The prompt ``generate`` was called with (``inputs`` or ``input_ids``), or ``None``."""
    prompt = named.get("inputs")
    return named.get("input_ids") if prompt is None else prompt


def _setting(model, generation_config, named, name, default):
    """A generation setting as transformers resolves it: the keyword argument, else the passed
    generation config's value, else the model's generation config's (a value left ``None`` in
    a passed config is filled from the model's), else ``default``."""
    for value in (named.get(name), getattr(generation_config, name, None),
                  getattr(model.generation_config, name, None)):
        if value is not None:
            return value
    return default


def _tokens_needed(model, named, generation_config, R) -> int | None:
    """Tokens a ``generate`` call may hold in its cache: prompt plus new tokens (or
    ``max_length``) plus the ``R`` of a verify window and one more; ``None`` without a prompt."""
    prompt = _prompt(named)
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
        return None
    P = prompt.shape[1]
    new = _setting(model, generation_config, named, "max_new_tokens", None)
    total = P + int(new) if new is not None else int(_setting(model, generation_config, named, "max_length", P))
    return max(total, P) + R + 1


def _is_assistant_call(generation_config, named) -> bool:
    """Whether this ``generate`` drafts for another model's (transformers marks the assistant's
    generation config ``is_assistant``); the model may be that other model itself, whose kept
    graphed cache is in use, so such a call gets a plain cache."""
    flag = named.get("is_assistant")
    return bool(getattr(generation_config, "is_assistant", False) if flag is None else flag)


GRAPH_CACHE_ROUND = 256  # a graphed cache's max_cache_len is rounded up to this many tokens (reuse across calls)


def _graph_cache(model, named, gen_config, R):
    """The cache of a ``cuda_graphs`` generate call: the model's kept one when it fits (batch
    size, state and model dtype, device, parameters, inference mode, enough tokens), else a
    new one kept in its place; ``None`` (the plain cache) for padded or embedding inputs."""
    prompt = _prompt(named)
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or named.get("inputs_embeds") is not None:
        return None
    mask = named.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return None
    pad = _setting(model, gen_config, named, "pad_token_id", None)
    if mask is None and pad is not None and bool((prompt == pad).any()):
        return None  # generate infers a padding mask from pad_token_id
    need = _tokens_needed(model, named, gen_config, R)
    config = model._recoverssm.config
    weight = model.get_input_embeddings().weight
    # graphs hold parameter addresses and the buffers' dtype, device and inference-ness
    made_for = (config.state_dtype, config.mode, weight.dtype, weight.device, torch.is_inference_mode_enabled(),
                tuple(p.data_ptr() for p in model.parameters()))
    kept = model._recoverssm.kept
    cache = kept.cache
    if cache is not None and cache.kv_capacity >= need and kept.made_for == made_for:
        cache.reset()
        cache.max_pending = R  # not the deepest of earlier calls: prompts prefill as usual
        if cache.rollback is not None:
            cache.rollback.max_pending = R
        return cache
    length = -(-need // GRAPH_CACHE_ROUND) * GRAPH_CACHE_ROUND
    kept.cache = cache = RecoverSSMCache(model, max_pending=R, state_dtype=config.state_dtype, max_cache_len=length,
                                         mode=config.mode)
    kept.made_for = made_for
    return cache


def _forward(self, *args, **kwargs):
    """``forward`` of a converted model: a RecoverSSMCache when a cache is wanted and none given;
    a cache with ``max_cache_len`` runs the forward through its graphed path."""
    key = self._recoverssm.cache_kwarg
    cache = kwargs.get(key, kwargs.get("past_key_values"))
    use_cache = kwargs.get("use_cache")
    if use_cache is None:  # the text model decides (a vision-language config keeps it in text_config)
        use_cache = getattr(self.config.get_text_config(), "use_cache", False)
    if isinstance(cache, RecoverSSMCache) and cache.graphed is not None:
        if not use_cache:  # a forward that must not touch the cache: without it, as transformers runs it
            kwargs = {k: v for k, v in kwargs.items() if k not in (key, "past_key_values")}
            return type(self).forward(self, *args, **kwargs)
        if args:
            kwargs = {**inspect.signature(type(self).forward).bind_partial(self, *args).arguments, **kwargs}
            kwargs.pop("self", None)
        return cache.graphed(self, kwargs)
    if use_cache and kwargs.get(key) is None and kwargs.get("past_key_values") is None:
        config = self._recoverssm.config
        kwargs[key] = RecoverSSMCache(self, state_dtype=config.state_dtype, mode=config.mode)
    return type(self).forward(self, *args, **kwargs)


def _bind(model, name, fn):
    """Set ``model.<name>`` to ``fn`` bound to the model, with the signature of the class's
    method (transformers inspects it) and rebinding to the copy under ``copy.deepcopy``.

    A model dispatched with a device map has an accelerate hook on ``forward`` (its inputs to
    the main device, its outputs back to the inputs' device): ``fn`` then replaces the method
    the hook wraps (``_old_forward``), so the hook keeps running around it."""
    @functools.wraps(getattr(type(model), name))
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    if name == "forward" and "_hf_hook" in model.__dict__ and "_old_forward" in model.__dict__:
        model._old_forward = types.MethodType(method, model)
        return
    setattr(model, name, types.MethodType(method, model))

