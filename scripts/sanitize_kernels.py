"""Every GDN and short-conv Triton kernel on small CUDA shapes, for ``compute-sanitizer``.

Runs each kernel through its launcher (no host validation, so wild metadata reaches the
kernels) on cases that stress the bounds: padding rows (slot < 0), empty and ragged windows,
counts 0..W and past the window (clamped), out-of-range slots (skipped), boundary entries
(some out of range), a masked last V tile (V not a multiple of BV), each kernel's table tile
and the tiles 8/1 and 32/2, the fold with a previous window, the grouped commit, bf16 pools. The state
pool sits inside a larger NaN-poisoned buffer and the script checks that nothing outside the
slots it may write changed. Meant to be run as::

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize_kernels.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/sanitize_kernels.py

(``scripts/gpu_check.sh sanitize`` runs both). Exits 0 and prints the number of launches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ssm_spec.ops.gdn.commit import launch_gdn_commit  # noqa: E402
from ssm_spec.ops.gdn.verify import launch_gdn_window  # noqa: E402
from ssm_spec.ops.short_conv.commit import launch_short_conv_commit  # noqa: E402
from ssm_spec.ops.short_conv.verify import launch_short_conv_verify  # noqa: E402
from tests.helpers import gdn_inputs, i32, qsl_from_lengths  # noqa: E402

import os  # noqa: E402

# CUDA; or the CPU under TRITON_INTERPRET=1 (a smoke test of this script)
DEV = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
NAN = float("nan")
# a small shape with a masked last V tile, and Qwen3-Next's (only the small one under the interpreter)
GDN_SHAPES = [(4, 2, 16, 24)] + ([(32, 16, 128, 128)] if DEV.type == "cuda" else [])


def fenced_pool(S, shape, dtype):
    """A pool of ``S`` slots inside a buffer with 3 NaN slots after it (a stray write shows)."""
    buf = torch.full((S + 3, *shape), NAN, device=DEV).to(dtype)
    buf[:S] = torch.randn(S, *shape, device=DEV).to(dtype)
    return buf, buf[:S]


def gdn_cases(launches: list) -> None:
    lengths = [4, 0, 3, 4, 1]
    srcs = [0, 2, -1, 5, 9]  # 9 is out of range (S = 8): skipped
    qsl = qsl_from_lengths(lengths, DEV)
    src = i32(srcs, DEV)
    for HV, H, K, V in GDN_SHAPES:
        for state_dtype in (torch.float32, torch.bfloat16):
            T = int(qsl[-1]) + 2
            inp = gdn_inputs(T, H, HV, K, V, DEV, dtype=torch.bfloat16)
            buf, pool = fenced_pool(8, (HV, K, V), state_dtype)
            before = buf.clone()
            tiles = [None, (max(2, 1 << (K - 1).bit_length()), 8, 1), (max(2, 1 << (K - 1).bit_length()), 32, 2)]
            for tile in tiles:
                out = torch.empty(T, HV, V, device=DEV, dtype=torch.bfloat16)
                rec = (torch.empty(T, HV, V, device=DEV), torch.empty(T, H, K, device=DEV),
                       torch.empty(T, HV, device=DEV))
                launch_gdn_window(*inp.args(), pool, src, qsl, None, out, rec, K**-0.5, True, config=tile)
                launches.append("verify")
                counts = i32([4, 0, 2, 7, 1], DEV)  # 7 > window: clamped
                dst = i32([0, -1, 3, 6, 1], DEV)
                bidx = i32([[1, 9], [-1, -1], [4, 4], [7, -1], [2, 3]], DEV)
                boff = i32([[2, 3], [1, 1], [1, 2], [9, 1], [1, 0]], DEV)
                launch_gdn_commit(pool, *rec, qsl, src, counts, dst, bidx, boff, config=tile)
                launches.append("commit")
                snap = i32([6, 7, -1, 4, 3, 1, -1, 12, -1, -1, -1, -1, -1, -1][:T], DEV)  # 12 out of range
                snap_src = i32([5, -1, -1, 2, -1], DEV)
                launch_gdn_window(*inp.args(), pool, snap_src, qsl, snap, out, None, K**-0.5, True, config=tile)
                launches.append("snapshot")
                launch_gdn_window(*inp.args(), pool, src, qsl, None, out, tuple(torch.empty_like(r) for r in rec),
                                  K**-0.5, True, config=tile, fold=(*rec, qsl[:-1].contiguous(), counts))
                launches.append("folded")
            grouped = torch.stack([pool, pool.clone()])
            launch_gdn_commit(grouped, *(torch.stack([r, r]) for r in rec), qsl, src, counts, dst, bidx, boff)
            launches.append("grouped commit")
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(buf[8:].float().nan_to_num(1.0), before[8:].float().nan_to_num(1.0)), "a write past the pool"


def conv_cases(launches: list) -> None:
    lengths = [3, 0, 4, 2]
    srcs = [1, 3, -1, 6]
    qsl = qsl_from_lengths(lengths, DEV)
    src = i32(srcs, DEV)
    for C, ks, dil in [(40, 4, 1), (96, 3, 2)]:
        Lc = (ks - 1) * dil
        T = int(qsl[-1]) + 1
        x = torch.randn(T, C, device=DEV)
        w = torch.randn(C, ks, device=DEV)
        for bias in (None, torch.randn(C, device=DEV)):
            buf, state = fenced_pool(6, (Lc, C), torch.float32)
            before = buf.clone()
            out, rec = torch.empty(T, C, device=DEV), torch.empty(T, C, device=DEV)
            launch_short_conv_verify(x, w, bias, state, src, qsl, out, rec, dil, "silu")
            counts = i32([2, 0, 9, 2], DEV)
            launch_short_conv_commit(state, rec, qsl, src, counts, i32([1, -1, 2, 4], DEV),
                                     i32([[0], [-1], [5], [7]], DEV), i32([[1], [1], [1], [2]], DEV))
            launch_short_conv_commit(torch.stack([state, state.clone()]), torch.stack([rec, rec]), qsl, src, counts,
                                     src, i32([[-1]] * 4, DEV), i32([[1]] * 4, DEV))
            launches += ["conv verify", "conv commit", "grouped conv commit"]
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(buf[6:].nan_to_num(1.0), before[6:].nan_to_num(1.0)), "a write past the pool"


def main() -> int:
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (a smoke test on the CPU: TRITON_INTERPRET=1)")
        return 1
    launches: list[str] = []
    gdn_cases(launches)
    conv_cases(launches)
    kinds = sorted(set(launches))
    print(f"sanitize_kernels: {len(launches)} launches of {len(kinds)} kinds ({', '.join(kinds)}) ran clean")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
