"""Small Qwen3-Next / Qwen3.5 models of every published class with random weights, and a
byte-level tokenizer.

They let the main job, the examples and the tests run offline on a fresh machine: nothing is
downloaded. The configs keep every structural feature of the real models (GDN layers with
grouped value heads, full-attention layers every fourth layer, the Qwen3-Next qkvz/ba and the
Qwen3.5 split projections) at small widths.
"""

from __future__ import annotations

import torch

BYTE_VOCAB = 256
EOS_TOKEN_ID = 256  # the one special token after the 256 byte values
PAD_TOKEN_ID = 257


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus ``eos`` (256) and ``pad`` (257).

    Enough of a tokenizer for ``generate`` and the CLI: ``encode(text) -> list[int]`` and
    ``decode(ids) -> str`` (special ids dropped, invalid UTF-8 replaced with U+FFFD).
    """

    eos_token_id = EOS_TOKEN_ID
    pad_token_id = PAD_TOKEN_ID
    vocab_size = PAD_TOKEN_ID + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, **kwargs) -> str:
        """The bytes of ``ids`` (a token id, a list or a tensor of them; ids past the byte range, such
        as the pad and EOS ids, dropped) as UTF-8 text. ``kwargs`` (transformers' streamers pass
        ``skip_special_tokens``) are accepted and ignored: this tokenizer has no special text."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        ids = [ids] if isinstance(ids, int) else list(ids)
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


#: The model classes :func:`tiny_model` builds, by ``kind``: the published Qwen3-Next (dense
#: MLPs, or expert layers in every layer as the released checkpoints have) and Qwen3.5 (dense,
#: mixture of experts, and the vision-language class whose text model has the GDN layers).
KINDS = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_next_moe": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration",
}


def tiny_config(kind: str = "qwen3_next", *, hidden_size: int = 64, num_layers: int = 4,
                linear_num_key_heads: int = 2, linear_num_value_heads: int = 4, linear_head_dim: int = 16,
                num_experts: int = 4, **overrides):
    """A small config of one of :data:`KINDS`.

    Layer types repeat (linear, linear, linear, full) as in the released models. ``qwen3_next``
    keeps dense MLPs (``mlp_only_layers`` covers every layer) so the model stays small;
    ``qwen3_next_moe`` and ``qwen3_5_moe`` have expert layers everywhere (``num_experts``, top-2,
    a shared expert), as published; ``qwen3_5_vl`` is a ``Qwen3_5Config`` whose ``text_config``
    is the ``qwen3_5`` one, with a one-block vision tower, and ``qwen3_5_moe_vl`` the same around
    the ``qwen3_5_moe`` text model (``Qwen3_5MoeConfig``). The vocabulary is the byte
    tokenizer's. ``overrides`` go to the (text) config unchanged.

    Raises:
        ValueError: an unknown ``kind``.
    """
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    common = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads,
                  linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
                  linear_conv_kernel_dim=4, layer_types=layer_types, max_position_embeddings=4096,
                  eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None,
                  tie_word_embeddings=False)
    experts = dict(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                   shared_expert_intermediate_size=hidden_size)
    if kind.startswith("qwen3_next"):
        dense = list(range(num_layers)) if kind == "qwen3_next" else []
        cfg = transformers.Qwen3NextConfig(**common, mlp_only_layers=dense, **experts)
    elif kind.startswith("qwen3_5_moe"):
        cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in common.items() if k != "intermediate_size"},
                                                **experts)
    else:
        cfg = transformers.Qwen3_5TextConfig(**common)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    if kind.endswith("_vl"):
        text = cfg.to_dict()
        for key in ("architectures", "model_type", "transformers_version"):
            text.pop(key, None)
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=hidden_size)
        config_cls = transformers.Qwen3_5MoeConfig if kind == "qwen3_5_moe_vl" else transformers.Qwen3_5Config
        cfg = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return cfg


def tiny_model(kind: str = "qwen3_next", seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.2,
               embed_std: float = 10.0, residual_scale: float = 0.5, device=None, **config_kwargs):
    """A causal LM built from :func:`tiny_config` with random weights, seeded, in eval mode.

    Random weights at an untrained scale give a flat next-token distribution and text that
    never repeats. These are scaled so the model behaves more like a trained one for the
    purposes of speculative decoding: linear weights ``N(0, std)`` (peaked logits, clear greedy
    winners), embeddings ``N(0, embed_std)`` with the mixers' and MLPs' output projections
    scaled by ``residual_scale`` (the residual stream leans on the current token, so greedy
    text falls into loops that prompt lookup can draft from, while the GDN layers still decide
    most tokens), and the ``eos``/``pad`` rows of the output layer zero (runs go to
    ``max_new_tokens``). ``A_log ~ U(-2, 0.5)`` and ``dt_bias ~ N(0, 0.5)`` give a mix of slow
    and fast decays.

    ``device``: build and draw the weights there (a generator on that device: other numbers
    than the default CPU build's, drawn in seconds instead of the minute a 3 B-parameter width
    takes on a CPU); ``None`` builds on the CPU.

    Returns the class :data:`KINDS` names for ``kind`` (``Qwen3NextForCausalLM``,
    ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, ``Qwen3_5ForConditionalGeneration`` or
    ``Qwen3_5MoeForConditionalGeneration``).

    Raises:
        ValueError: an unknown ``kind``.
    """
    import transformers

    cfg = tiny_config(kind, **config_kwargs)
    cls = getattr(transformers, KINDS[kind])
    device = torch.device("cpu" if device is None else device)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)
    on = dict(generator=gen, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(-2, 0.5, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, **on) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, **on) * embed_std)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, **on) * std)
                if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                    p.mul_(residual_scale)
        model.lm_head.weight[BYTE_VOCAB:] = 0
    return model.to(dtype).eval()
