"""Export a GDN stack's verify step with torch.export and, where Torch-TensorRT is installed,
compile it; the commit runs in PyTorch on the records the program returns.

    python examples/tensorrt_verify.py [--device cuda]

Without ``torch_tensorrt`` (it cannot be installed in this project's test environments) it
exports, checks the program against eager on a second batch shape, commits, and says why the
TensorRT step was skipped.
"""

from __future__ import annotations

import argparse

import torch

from ssm_spec import RecoverGatedDeltaNet, RecoverShortConv, tensorrt
from ssm_spec.export import VerifyForward, commit_records, example_inputs, export_verify


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    layers = [RecoverGatedDeltaNet(64, 2, 4, 16, 16), RecoverShortConv(64, 4, dilation=2),
              RecoverGatedDeltaNet(64, 2, 4, 16, 16)]
    verify = VerifyForward([layer.to(args.device) for layer in layers]).eval()

    ep = export_verify(verify, example_inputs(verify, 8, [4, 4, 2], device=args.device))  # dynamic T and B
    ours = sorted({str(n.target) for n in ep.graph.nodes if str(n.target).startswith("ssm_spec.")})
    print("exported; ssm_spec nodes:", ", ".join(ours))

    hidden, gdn, conv, slots, qsl = example_inputs(verify, 8, [3, 1, 4, 4], device=args.device, seed=1)
    out, records = ep.module()(hidden, gdn, conv, slots, qsl)
    same = torch.equal(out, verify(hidden, gdn, conv, slots, qsl)[0])
    print("exported program == eager on another batch shape:", same)

    n = torch.tensor([2, 1, 4, 3], dtype=torch.int32, device=args.device)  # accepted tokens per row
    commit_records(verify, records, gdn, conv, qsl, slots, n)  # the commit stays in PyTorch
    print("committed", n.tolist(), "tokens per row")

    ok, why = tensorrt.available()
    if not ok or args.device != "cuda":
        print("TensorRT step skipped:", why if not ok else "needs --device cuda")
        return 0 if same else 1
    flat = (hidden, *gdn, *conv, slots, qsl)
    trt_module, placement = tensorrt.compile_verify(ep, list(flat))
    print("placement:", placement)
    got = trt_module(*flat)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = verify(hidden, gdn, conv, slots, qsl)[0]
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    print(f"TensorRT vs eager: relative error {err:.2e}")
    return 0 if same and err < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
