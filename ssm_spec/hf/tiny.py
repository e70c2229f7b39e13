"""Small Qwen3-Next / Qwen3.5 causal LMs with random weights, and a byte-level tokenizer.

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

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def tiny_config(kind: str = "qwen3_next", *, hidden_size: int = 64, num_layers: int = 4,
                linear_num_key_heads: int = 2, linear_num_value_heads: int = 4, linear_head_dim: int = 16,
                **overrides):
    """A small Qwen3-Next (``kind="qwen3_next"``) or Qwen3.5 (``"qwen3_5"``) text config.

    Layer types repeat (linear, linear, linear, full) as in the released models; the MLPs are
    dense (``mlp_only_layers`` covers every Qwen3-Next layer) so the model stays small. The
    vocabulary is the byte tokenizer's. ``overrides`` go to the config unchanged.

    Raises:
        ValueError: an unknown ``kind``.
    """
    import transformers

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    common = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads,
                  linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
                  linear_conv_kernel_dim=4, layer_types=layer_types, max_position_embeddings=4096,
                  eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None,
                  tie_word_embeddings=False)
    if kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**common, mlp_only_layers=list(range(num_layers)), num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                                           shared_expert_intermediate_size=hidden_size)
    elif kind == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**common)
    else:
        raise ValueError(f"kind: expected 'qwen3_next' or 'qwen3_5', got {kind!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(kind: str = "qwen3_next", seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.2,
               embed_std: float = 10.0, residual_scale: float = 0.5, **config_kwargs):
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

    Returns ``Qwen3NextForCausalLM`` or ``Qwen3_5ForCausalLM``.
    """
    import transformers

    cfg = tiny_config(kind, **config_kwargs)
    cls = transformers.Qwen3NextForCausalLM if kind == "qwen3_next" else transformers.Qwen3_5ForCausalLM
    gen = torch.Generator().manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-2, 0.5, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * embed_std)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
                if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                    p.mul_(residual_scale)
        model.lm_head.weight[BYTE_VOCAB:] = 0
    return model.to(dtype).eval()
