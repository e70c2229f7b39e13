"""The multi-token-prediction (MTP) head that Qwen3-Next and Qwen3.5 checkpoints carry beside the
model (``mtp.*`` tensors), built from the target's own transformers classes.

What it computes, as the public engines define it (facts read from vLLM's
``vllm/model_executor/models/qwen3_next_mtp.py`` and ``qwen3_5_mtp.py`` and SGLang's
``python/sglang/srt/models/qwen3_next_mtp.py``; no code taken from them)::

    e = pre_fc_norm_embedding(embed_tokens(x[t + 1]))
    h = pre_fc_norm_hidden(h[t])
    z = fc(cat([e, h], -1))                 # 2H -> H, no bias, the embedding first
    z = layers[step % num_layers](z)        # one full-attention decoder layer of the target's class
    g = norm(z)                             # the head's output hidden state
    logits = lm_head(g)                     # the target's own head

* ``h[t]`` is the target's last hidden state **after its final norm**: vLLM's
  ``Qwen3NextModel.forward`` (``vllm/model_executor/models/qwen3_next.py``) returns
  ``self.norm(hidden_states, residual)``, the tensor its ``compute_logits`` reads and its
  speculative proposer hands to the MTP model as ``hidden_states``; SGLang's
  ``Qwen3NextForCausalLM`` (``python/sglang/srt/models/qwen3_next.py``) hands the normed states
  to its ``LogitsProcessor``, which keeps them for the draft, and its MTP model reads them as
  ``forward_batch.spec_info.hidden_states``.
* The pair ``(h[t], x[t + 1])`` sits at the target's position ``t`` (vLLM shifts the token ids
  by one and keeps the positions) and predicts ``x[t + 2]``.
* Draft step ``j > 0`` feeds the head's own output ``g`` (after ``norm``) back as the hidden
  state, with the token it drafted, one position further on: vLLM's proposer uses the MTP
  model's single return value both for the logits and as the next step's hidden states
  (``method == "mtp"`` in ``vllm/v1/spec_decode``), and picks layer ``step % num_mtp_layers``.
* The norms are Gemma-style RMSNorms (``x * (1 + w)``): here the target's own norm class.
* Embeddings and the LM head are the target's (no ``mtp.embed_tokens`` / ``mtp.lm_head``).
* The decoder layer is the target's decoder-layer class for a full-attention layer, its MLP
  chosen by the target's rule for layer index 0 (vLLM builds ``mtp.layers.N`` with layer
  index ``N`` parsed from its prefix): dense for Qwen3.5 and the dense tiny Qwen3-Next, experts
  plus a shared expert for the released Qwen3-Next and Qwen3.5-MoE.
* Layer count: ``mtp_num_hidden_layers`` (Qwen3.5) or ``num_nextn_predict_layers``
  (Qwen3-Next); the released checkpoints have one.
"""

from __future__ import annotations

import copy
import inspect
import numbers

import torch
from torch import nn

__all__ = ["MTPHead", "text_decoder", "attention_config", "mtp_layer_count", "config_layer_count", "declared_layer_count",
           "missing_layer_count", "LAYER_COUNT_NAMES"]

#: The config attributes that give the MTP layer count: Qwen3.5's, then Qwen3-Next's.
LAYER_COUNT_NAMES = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def text_decoder(model: nn.Module) -> nn.Module:
    """The text decoder of a Qwen3-Next / Qwen3.5 causal LM or vision-language model (the module
    holding ``layers``, ``norm`` and ``rotary_emb``: ``model.model``, or
    ``model.model.language_model`` for the ``*ForConditionalGeneration`` classes).

    Raises:
        ValueError: no such module.
    """
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and hasattr(m, "rotary_emb") and hasattr(m, "norm") and any(
                hasattr(layer, "self_attn") for layer in layers):
            return m
    raise ValueError(f"MTP head: {type(model).__name__} has no Qwen3-Next / Qwen3.5 text decoder (a module with "
                     "`layers` holding full-attention `self_attn` layers, `norm` and `rotary_emb`)")


def _attention_layer(decoder: nn.Module) -> nn.Module:
    for layer in decoder.layers:
        if hasattr(layer, "self_attn"):
            return layer
    raise ValueError("MTP head: the decoder has no full-attention layer")  # text_decoder checked it


def attention_config(model: nn.Module):
    """The text config object the target's own attention layers read (``_attn_implementation``,
    ``_experts_implementation`` switch there), which the head's layers share."""
    return _attention_layer(text_decoder(model)).self_attn.config


def mtp_layer_count(model: nn.Module) -> int:
    """The MTP layer count a checkpoint declares: ``mtp_num_hidden_layers`` (Qwen3.5) or
    ``num_nextn_predict_layers`` (Qwen3-Next), looked up in the text config, then the top-level
    config (:func:`config_layer_count` of ``model.config``).

    Raises:
        ValueError: neither attribute is set, the count is not an integer, or below 1.
    """
    return config_layer_count(model.config)


def config_layer_count(config) -> int:
    """:func:`mtp_layer_count` from a transformers config (a model's, or one read with
    ``AutoConfig`` before any weight loads).

    Raises:
        ValueError: neither attribute is set, the count is not an integer, or below 1.
    """
    count = declared_layer_count(config)
    if count is None:
        raise ValueError(missing_layer_count(config) + " (a checkpoint with an MTP head declares it in config.json)")
    return count


def missing_layer_count(config, beside: str | None = None) -> str:
    """The error text for a ``config`` that declares no MTP layer count (nor does ``beside``,
    the ``config.json`` looked at next, where given)."""
    return (f"MTP head: the model's config ({type(config).__name__}) sets neither {LAYER_COUNT_NAMES[0]} (Qwen3.5) "
            f"nor {LAYER_COUNT_NAMES[1]} (Qwen3-Next)" + (f", nor does {beside}" if beside else "")
            + ": the MTP layer count is missing")


def declared_layer_count(config, where: str = "the model's config") -> int | None:
    """The MTP layer count ``config`` declares (:data:`LAYER_COUNT_NAMES`, in its text config,
    then at its top level), or ``None`` where it sets neither. ``config``: a transformers config,
    or the ``dict`` of a ``config.json`` (``where`` names it in errors).

    Raises:
        ValueError: the count is not an integer, or below 1.
    """
    if isinstance(config, dict):
        text = config.get("text_config")
        configs = [text if isinstance(text, dict) else {}, config]
        get = dict.get
    else:
        configs = [config.get_text_config(), config]
        get = lambda cfg, name: getattr(cfg, name, None)  # noqa: E731
    for cfg in configs:
        for name in LAYER_COUNT_NAMES:
            value = get(cfg, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"MTP head: {where} has {name}={value!r}: expected an integer count of MTP layers")
            if value < 1:
                raise ValueError(f"MTP head: {where} has {name}={value}: the checkpoint declares no MTP "
                                 "layer, so there is no head to draft with")
            return int(value)
    return None


class MTPHead(nn.Module):
    """The Qwen3-Next / Qwen3.5 MTP head (module docstring): ``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``layers`` (``num_layers`` decoder layers of the target's class) and
    ``norm``, under the published names less their ``mtp.`` prefix. Embeddings and LM head
    are not part of it: the caller passes the target's.

    Build it with :meth:`for_model` (on the ``meta`` device, then load weights with
    :func:`~ssm_spec.hf.mtp.load_mtp_head`).

    Args:
        config: the target's text config (shared by reference with the layers' attention and
            expert modules after construction, so implementation switches on the target reach
            them).
        layer_cls / norm_cls: the target's decoder-layer and RMSNorm classes.
        num_layers: MTP layers.
    """

    def __init__(self, config, layer_cls: type[nn.Module], norm_cls: type[nn.Module], num_layers: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = norm_cls(H, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(H, eps=eps)
        built = copy.deepcopy(config)  # layer 0 as a full-attention layer: the MLP follows the target's rule there
        built.layer_types = ["full_attention", *list(config.layer_types)[1:]]
        self.layers = nn.ModuleList()
        for j in range(int(num_layers)):
            layer = layer_cls(built, 0)
            layer.self_attn.layer_idx = j  # the head's own KV buffer of this layer
            self.layers.append(layer)
        for m in self.modules():  # read implementation switches from the target's config, not the copy
            if getattr(m, "config", None) is built:
                m.config = config
        self.norm = norm_cls(H, eps=eps)
        self.num_layers = int(num_layers)
        params = inspect.signature(layer_cls.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def for_model(cls, model: nn.Module, num_layers: int | None = None, device="meta") -> MTPHead:
        """An empty head shaped for ``model`` (its decoder-layer and norm classes, its text
        config), on ``device`` (``meta``: no memory until weights are assigned).

        Raises:
            ValueError: not a Qwen3-Next / Qwen3.5 model; the layer count missing, not an
                integer or below 1 (:func:`mtp_layer_count`).
        """
        decoder = text_decoder(model)
        layer = _attention_layer(decoder)
        count = mtp_layer_count(model) if num_layers is None else int(num_layers)
        with torch.device(device):
            return cls(layer.self_attn.config, type(layer), type(decoder.norm), count)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, attention_mask,
                position_ids: torch.Tensor, cache, step: int = 0) -> torch.Tensor:
        """One application of the head.

        Args:
            embeds: ``[B, L, H]`` the target's embeddings of the next tokens ``x[t + 1]``.
            hidden: ``[B, L, H]`` the hidden states ``h[t]`` (the target's after its final norm,
                or the head's own output for a later draft step).
            position_embeddings: ``(cos, sin)`` of the target's rotary embedding at the pairs'
                positions ``t``.
            attention_mask: the mask the layer's attention takes (over the cache's columns).
            position_ids: ``[B, L]`` int64 positions ``t``.
            cache: the object the layer's attention writes its keys and values to
                (``update(keys, values, layer_idx, ...)``), or ``None``.
            step: the draft step; layer ``step % num_layers`` runs.

        Returns:
            ``[B, L, H]`` the head's output hidden states ``g`` (after ``norm``), in the input
            dtype; ``lm_head(g)`` are the draft logits.
        """
        e = self.pre_fc_norm_embedding(embeds)
        h = self.pre_fc_norm_hidden(hidden)
        z = self.fc(torch.cat([e, h], dim=-1))
        z = self.layers[step % self.num_layers](z, position_embeddings=position_embeddings,
                                                attention_mask=attention_mask, position_ids=position_ids,
                                                **{self.cache_kwarg: cache})
        if isinstance(z, tuple):  # decoder layers of some releases return (hidden, ...)
            z = z[0]
        return self.norm(z)
