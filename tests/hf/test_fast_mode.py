"""Fast mode in the Hugging Face path: greedy decoding of the tiny Qwen3-Next and Qwen3.5
models in fp32 over 1,024 tokens equals plain greedy up to the first near-tie (docs/design.md
section 2.6: the closed-form verify moves logits by rounding, so only a near-tie can flip)."""

import pytest
import torch

from ssm_spec.hf import apply_recoverssm, recoverssm_config, tiny_model
from ssm_spec.hf.tiny import ByteTokenizer
from tests.helpers import first_divergence

TOK = ByteTokenizer()
NEAR_TIE = 1e-3


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_fast_mode_greedy_equals_plain_up_to_the_first_near_tie(device, kind):
    ref = tiny_model(kind, seed=0).to(device)
    model = apply_recoverssm(tiny_model(kind, seed=0).to(device), mode="fast")
    ids = torch.tensor([TOK.encode("the cat sat on the mat. the cat sat on the")], device=device)
    n = 1024
    plain = ref.generate(ids, max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True)
    fast = model.generate(ids, max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=3)
    parted = first_divergence(plain, fast, ids.shape[1])
    if parted is not None:
        p, top2 = parted
        gap = float(top2[0] - top2[1])
        print(f"{kind}: fast mode parts from plain greedy at new token {p} (logit gap {gap:.3g})")
        assert gap < NEAR_TIE, (p, gap)
    else:
        gaps = torch.stack([s[0].float().topk(2).values for s in plain.scores])
        print(f"{kind}: fast mode equals plain greedy over {n} tokens (smallest logit gap "
              f"{float((gaps[:, 0] - gaps[:, 1]).min()):.3g})")


def test_mode_switch_validation():
    model = tiny_model("qwen3_next", seed=0)
    with pytest.raises(ValueError, match="mode"):
        apply_recoverssm(model, mode="quick")
    apply_recoverssm(model, mode="fast")
    assert recoverssm_config(model).mode == "fast"
    apply_recoverssm(model, mode="exact")
    assert recoverssm_config(model).mode == "exact"
