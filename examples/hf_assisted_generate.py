"""Speculative decoding through Hugging Face ``generate`` on a Qwen3-Next model.

    python examples/hf_assisted_generate.py [--model PATH]

Without ``--model`` it builds ssm-spec's tiny random Qwen3-Next (offline); with a local
checkpoint directory it loads that model (and reuses it as its own assistant).
"""

import argparse

import torch
import transformers

from ssm_spec.hf import ByteTokenizer, apply_recoverssm, tiny_model


def main(argv=None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--model", help="a local Qwen3-Next / Qwen3.5 checkpoint directory")
    args = args.parse_args(argv)
    load = (lambda: transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)) \
        if args.model else (lambda: tiny_model("qwen3_next", seed=0))
    tok = transformers.AutoTokenizer.from_pretrained(args.model) if args.model else ByteTokenizer()
    ids = torch.tensor([tok.encode("the cat sat on the mat. the cat sat on the")])

    plain = load().generate(ids, max_new_tokens=64, do_sample=False)   # transformers' own decoding
    model = apply_recoverssm(load())                                  # convert in place
    lookup = model.generate(ids, max_new_tokens=64, do_sample=False, prompt_lookup_num_tokens=5)
    assisted = model.generate(ids, max_new_tokens=64, do_sample=False, assistant_model=apply_recoverssm(load()))
    apply_recoverssm(model, cuda_graphs=True)                         # replay forwards as CUDA graphs
    graphed = model.generate(ids, max_new_tokens=64, do_sample=False, prompt_lookup_num_tokens=5)

    print(repr(tok.decode(lookup[0, ids.shape[1]:])))
    same = all(torch.equal(out, plain) for out in (lookup, assisted, graphed))
    print("prompt lookup, assisted and graphed tokens equal plain greedy:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
