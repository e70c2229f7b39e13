"""Does the decode loop's round capture as a CUDA graph on this model, and if not, where does it
synchronise? (CUDA only.)

Builds the model of ``bench_hf_generate.py``'s width options on the GPU, converts it with
``cuda_graphs=True`` and runs ``generate`` through the decode loop, plain and with prompt lookup,
at each ``--batch``. For each run it prints whether the round was captured, the replays and
eager rounds, and the captured tokens against the eager loop's (``torch.equal``). Where a capture
was refused it runs one round again with torch's sync debug mode on "warn" and lists every
synchronising call with its stack outside torch, so one run names every sync, not only the first.

    python scripts/diag_loop_capture.py --kind qwen3_5 --hidden 2560 --layers 32 ... --batch 1 8
"""

from __future__ import annotations

import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def syncs_of(fn) -> collections.Counter:
    """``{stack outside torch: count}`` of every synchronising call while ``fn()`` runs."""
    seen = collections.Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename]
        seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}: {(f.line or '').strip()[:90]}"
                         for f in reversed(frames[-4:]))] += 1

    mode = torch.cuda.get_sync_debug_mode()
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            fn()
            torch.cuda.set_sync_debug_mode(mode)
    finally:
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode(mode)
    return seen


def main(argv=None) -> int:
    from bench_hf_generate import parse_args
    from hf_loop_runs import batch_prompt
    from hf_runs import SENTENCE, device_model

    from ssm_spec.hf import ByteTokenizer, apply_recoverssm

    args = parse_args(argv)
    device = torch.device(args.device or "cuda")
    model = device_model(args, device)
    apply_recoverssm(model, decode_loop=True, cuda_graphs=True)
    tok = ByteTokenizer()
    new = args.new_tokens or 32
    bad = 0
    for B in args.batch:
        ids = batch_prompt(tok, SENTENCE, args.prompt_repeats or 3, B, device)
        for name, kw in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": args.num_draft_tokens})):
            apply_recoverssm(model, decode_loop=True, cuda_graphs=True)
            t = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                out = model.generate(ids, max_new_tokens=new, do_sample=False, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first = time.perf_counter() - t
            loop = model._recoverssm.loop
            captured = loop.graph is not None
            t = time.perf_counter()
            again = model.generate(ids, max_new_tokens=new, do_sample=False, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            second = time.perf_counter() - t
            apply_recoverssm(model, decode_loop=True, cuda_graphs=False)
            eager = model.generate(ids, max_new_tokens=new, do_sample=False, **kw)
            same = torch.equal(out, eager) and torch.equal(again, eager)
            bad += (not captured) + (not same)
            print(f"batch {B} {name:6s}: captured {captured}, replays {loop.replays}, eager rounds "
                  f"{loop.eager_rounds}, equals eager {same}, first call {first:.2f} s, second {second:.3f} s "
                  f"({B * new / second:.1f} tok/s)", flush=True)
            for w in caught:
                print("   warning:", str(w.message)[:600])
            if not captured and device.type == "cuda":
                loop.rows.finished.fill_(True)
                for where, n in syncs_of(loop._rounds).most_common():
                    print(f"   sync x{n}: {where}")
    print("diag loop capture:", "ok" if bad == 0 else f"{bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
