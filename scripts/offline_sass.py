"""Compile the fast-mode kernel for Hopper without a GPU and count its SASS, per loop.

Kernel changes are mostly made away from the GPU, so a change's instruction count is the one
number it can be judged by before the H200 times it (docs/perf-notes.md: "prediction" before
"outcome"). Triton's own compiler (its bundled ``ptxas`` and ``cuobjdump``) builds
``gdn_closed_form_kernel`` for ``sm_90`` with the specialisation a real launch gets on contiguous
tensors at the benchmark's widths (unit strides folded to 1, every other pointer and stride
divisible by 16, ``T``, ``S``, ``R``, ``L`` and ``PMAX`` not specialised), and prints the total,
the local-memory (spill) instructions and each loop's body: a backward branch's range, innermost
first. With a pending block ``PP > 4`` the chunk loop holds one copy of the fold's block-of-4
loop, so a fold of ``p`` pending issues ``chunk - block + ceil(p / 4) * block`` per chunk::

    python scripts/offline_sass.py --window 4 --max-pending 16          # lazy, L=16 (PP = 16)
    python scripts/offline_sass.py --window 4 --plain                   # the read-only verify
    python scripts/offline_sass.py --window 4 --max-pending 16 --sass k.sass   # keep the SASS

The counts are static (an instruction in a loop counts once) and depend on the Triton version:
run it with Triton 3.6 (a venv with ``pip install triton==3.6.0``) to see the H200's code.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Strides of contiguous inputs that are 1 (a real launch folds them into the binary).
UNIT_STRIDES = ("s_qk", "s_kk", "s_vv", "s_gh", "s_bh", "s_sv", "s_slot", "s_qsl", "s_ov", "s_ruv", "s_rkk",
                "s_rgh", "s_ps", "s_pc")
#: The kernel's ``do_not_specialize`` integers, and the float scale.
UNSPECIALISED = ("T", "S", "R", "L", "PMAX", "scale")
INT32_POINTERS = ("slot_ptr", "qsl_ptr", "pstart_ptr", "pcount_ptr")


def compile_closed_form(window: int, max_pending: int | None, K: int = 128, V: int = 128, BV: int = 128,
                        num_warps: int = 1, max_registers: int | None = None, key_rows: int | None = None,
                        stages: int | None = None, prefetch: bool | None = None):
    """Triton's compiled ``gdn_closed_form_kernel`` for ``sm_90``: the plain form when
    ``max_pending`` is None, else the ring form with the pool's pending block
    (``PP = pending_block(ring_positions(max_pending, window), window)``), the block constants a
    launch gets (``block_constants``); ``key_rows`` overrides the state loop's chunk (``KC``) and
    ``stages`` its pipelining depth (``STAGES``), ``prefetch`` whether it loads a chunk ahead
    (``PREFETCH``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ssm_spec.ops.gdn.closed_form import MAX_REGISTERS, block_constants, gdn_closed_form_kernel, ring_positions
    from ssm_spec.ops.gdn.inner import block_k

    ring = max_pending is not None
    BK = block_k(K)
    blocks = block_constants(BK, window, ring_positions(max_pending, window) if ring else 1, ring, key_rows,
                             stages, prefetch)
    consts = dict(H=16, HV=32, K=K, V=V, BK=BK, BV=BV, **blocks, USE_QK_L2NORM=True, USE_PTX=True, RING=ring,
                  **{s: 1 for s in UNIT_STRIDES})
    names = gdn_closed_form_kernel.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = ("*i32" if name in INT32_POINTERS else "*fp32") if name.endswith("_ptr") else \
            ("fp32" if name == "scale" else "i32")
        if name not in UNSPECIALISED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=gdn_closed_form_kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    options = dict(num_warps=num_warps, maxnreg=max_registers or MAX_REGISTERS)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options), consts


def sass_of(compiled) -> str:
    """``cuobjdump -sass`` of a compiled kernel's cubin (Triton's bundled binary)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(tool), "-sass", cubin], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, opcode with modifiers)`` per instruction, predicates dropped."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s*(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """``(first address, last address, opcode counts)`` of each backward branch's range,
    innermost (shortest) first."""
    ins = instructions(sass)
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/.*\bBRA\b.*?0x([0-9a-f]+)\s*;", line)
        if m:
            src, dst = int(m.group(1), 16), int(m.group(2), 16)
            if dst < src and dst in index and src in index:
                body = ins[index[dst]:index[src] + 1]
                found.append((dst, src, collections.Counter(op.split(".")[0] for _, op in body)))
    return sorted(found, key=lambda x: sum(x[2].values()))


def summary(sass: str) -> dict:
    """Totals, local-memory instructions and the loops of :func:`loops`."""
    ins = instructions(sass)
    ops = collections.Counter(op.split(".")[0] for _, op in ins)
    return {"instructions": len(ins), "local": ops["STL"] + ops["LDL"], "ops": ops,
            "loops": [(a, b, sum(c.values()), c) for a, b, c in loops(sass)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=4, help="max_window W (WP = next_pow2(W))")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--max-pending", type=int, default=16, help="the lazy pool's L (the ring form)")
    g.add_argument("--plain", action="store_true", help="the read-only closed-form verify instead")
    p.add_argument("--bv", type=int, default=128, help="value tile (the B=64 table's 128)")
    p.add_argument("--warps", type=int, default=1)
    p.add_argument("--max-registers", type=int, default=None,
                   help="register cap (maxnreg; default the kernel's MAX_REGISTERS)")
    p.add_argument("--key-rows", type=int, default=None,
                   help="the state loop's key rows per chunk (KC; default the launch's)")
    p.add_argument("--stages", type=int, default=None,
                   help="the state loop's num_stages (STAGES; default the launch's)")
    p.add_argument("--prefetch", type=int, choices=(0, 1), default=None,
                   help="1: the state loop loads each chunk a chunk ahead (PREFETCH; default the launch's)")
    p.add_argument("--sass", type=Path, default=None, help="also write the SASS here")
    args = p.parse_args(argv)
    if args.window < 1 or args.max_pending < 0:
        p.error("--window must be >= 1 and --max-pending >= 0")
    import triton

    compiled, consts = compile_closed_form(args.window, None if args.plain else args.max_pending, BV=args.bv,
                                           num_warps=args.warps, max_registers=args.max_registers,
                                           key_rows=args.key_rows, stages=args.stages,
                                           prefetch=None if args.prefetch is None else bool(args.prefetch))
    sass = sass_of(compiled)
    if args.sass:
        args.sass.write_text(sass)
    s = summary(sass)
    form = "plain" if args.plain else f"ring L={args.max_pending}"
    print(f"gdn_closed_form_kernel sm_90, Triton {triton.__version__}: {form}, W={args.window} (WP={consts['WP']}, "
          f"PP={consts['PP']}, KC={consts['KC']}, STAGES={consts['STAGES']}, PREFETCH={int(consts['PREFETCH'])}), "
          f"BV={args.bv}, {args.warps} warp(s), "
          f"{compiled.metadata.maxnreg if hasattr(compiled.metadata, 'maxnreg') else '?'} registers at most")
    print(f"{s['instructions']} instructions, {s['local']} local-memory (spill) instructions; "
          + ", ".join(f"{k} {v}" for k, v in s["ops"].most_common(8)))
    for a, b, n, c in s["loops"]:
        print(f"loop {a:#06x}-{b:#06x}: {n} instructions; " + ", ".join(f"{k} {v}" for k, v in c.most_common(8)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
