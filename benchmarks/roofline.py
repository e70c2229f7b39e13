"""The roofline of ``bench_ops.py``: the bytes each GDN op must move and the fp32 ops it must do
(each model written once, as the JSON's text beside the code that evaluates it), the two measured
ceilings (copy bandwidth, FMA rate) and each kernel's fraction of its floor."""

from __future__ import annotations

import torch
from ops_workloads import Shape, lazy_phases
from timing import Timer

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the CPU smoke test still runs (torch FMA loop)
    triton = tl = None

GIB = 1 << 30
FMA_CHAINS = 4  # independent FMA chains per element in the FMA kernel

#: Minimum bytes each op must move (DRAM traffic of an ideal kernel), per layer and step.
#: Unique bytes are counted once (a key head shared by several value heads is read once);
#: the index/metadata tensors (a few bytes per row) are left out.
BYTES_MODEL = {
    "notation": "B rows, W = k + 1 tokens per row, T = B * W; es = state element size, "
                "ea = activation element size (q, k, v, beta, out); records and g are fp32",
    "slot": "HV * K * V * es  (one state slot)",
    "slot32": "HV * K * V * 4  (one fp32 state: fla's final state)",
    "act_in": "T * ((2*H*K + HV*V) * ea + HV * 4 + HV * ea)  (q, k, v; g fp32; beta)",
    "out": "T * HV * V * ea",
    "record_per_token": "(HV*V + H*K + HV) * 4  (u, k_hat, decay; fp32)",
    "verify": "B * slot + act_in + out + T * record_per_token  (read checkpoint; write out "
              "and the record)",
    "commit(n)": "2 * B * slot + B * n * record_per_token  (read src, write dst; read n "
                 "records per row)",
    "snapshot": "B * slot + T * slot + act_in + out  (read src; write W slots per row; "
                "write out)",
    "native_engine": "as snapshot (the engines' kernel: read the last accepted token's slot, "
                     "write every token's state into its own slot)",
    "folded": "B * slot + B * slot + act_in + out + T * record_per_token + B * W * "
              "record_per_token  (read the checkpoint, store the committed state once; write "
              "out and the record; read the previous window's W records per row)",
    "fla": "gather: 2 * B * slot + B * slot + act_in + out + B * slot32  (index_select of the "
           "rows' states: read + write; fla reads them, writes out and an fp32 final state); "
           "indexed (an fla taking ssm_state_indices): B * slot + act_in + out + B * slot",
    "fla_contig": "B * slot + act_in + out + B * slot32  (fla on the rows' slots as one "
                  "contiguous block: no gather)",
    "closed_form_verify": "as verify (fast mode: the state read once, contracted in closed form)",
    "closed_form_folded": "as folded with the ring's records: the checkpoint read, the fold of the W pending "
                          "tokens stored once, the window verified (max_pending = 1, all W accepted)",
    "lazy": "mean over one fold cycle (max_pending = 16, W - 1 accepted per step) of: B * slot + act_in + out + "
            "T * record_per_token + B * p * record_per_token (read the p pending records), plus B * slot on the "
            "step that folds",
    "copy": "2 * nbytes  (read + write)",
}


def bytes_moved(shape: Shape, B: int, peer_mode: str | None = None) -> dict[str, int]:
    """:data:`BYTES_MODEL` evaluated for ``B`` rows of ``shape.W`` tokens."""
    H, HV, K, V, W = shape.H, shape.HV, shape.K, shape.V, shape.W
    ea = shape.act_dtype.itemsize
    T = B * W
    slot = shape.slot_bytes
    slot32 = HV * K * V * 4
    act_in = T * ((2 * H * K + HV * V) * ea + HV * 4 + HV * ea)
    out = T * HV * V * ea
    rec_tok = shape.record_bytes_per_token
    moved = {
        "verify": B * slot + act_in + out + T * rec_tok,
        "commit_nW": 2 * B * slot + B * W * rec_tok,
        "commit_n1": 2 * B * slot + B * 1 * rec_tok,
        "snapshot": B * slot + T * slot + act_in + out,
        "folded": 2 * B * slot + act_in + out + T * rec_tok + B * W * rec_tok,
        "fla_contig": B * slot + act_in + out + B * slot32,
    }
    moved["native_engine"] = moved["snapshot"]  # the same traffic, the engines' structure
    moved["closed_form_verify"] = moved["verify"]
    moved["closed_form_folded"] = moved["folded"]
    phases = lazy_phases(W)
    moved["lazy"] = sum(B * slot + act_in + out + T * rec_tok + B * p * rec_tok + (B * slot if fold else 0)
                        for p, fold in phases) / len(phases)
    if peer_mode == "indexed":
        moved["fla"] = 2 * B * slot + act_in + out
    else:
        moved["fla"] = 2 * B * slot + B * slot + act_in + out + B * slot32
    return moved


#: fp32 arithmetic each op must do, counted per state element (E = HV * K * V per row) as
#: instructions: an FMA or a multiply is one op (the FMA kernel's rate is in the same unit;
#: FLOP/s = 2 * ops/s for FMAs).
OPS_MODEL = {
    "unit": "fp32 ops (one FMA or multiply = 1) per state element; E = HV * K * V",
    "verify": "4 * T * E  (per token: decay, correction reduction, rank-1 update, output "
              "reduction)",
    "commit(n)": "2 * B * n * E  (per replayed token: decay and rank-1 update)",
    "snapshot": "4 * T * E",
    "folded": "2 * B * W * E + 4 * T * E  (fold of the W previous tokens, then the verify)",
    "fla": "4 * T * E",
    "fla_contig": "4 * T * E",
    "closed_form_verify": "2 * T * E  (the window's 2W keys and queries against the state; the W x W solve and "
                          "the q/k Gram rows are O(W^2 (K + V)) per head and left out)",
    "closed_form_folded": "2 * B * W * E + 2 * T * E",
    "lazy": "2 * T * E per step, plus 2 * B * p * E on the step that folds p tokens (cycle mean)",
    "fma": f"n * iters * {FMA_CHAINS} FMAs on n fp32 elements (CPU: n * iters addcmul ops)",
    "roofline": "floor_us = max(bytes / copy bandwidth, ops / FMA rate); "
                "frac_roofline = floor_us / time_us; bound: which term sets the floor",
}


def op_counts(shape: Shape, B: int) -> dict[str, int]:
    """:data:`OPS_MODEL` evaluated for ``B`` rows of ``shape.W`` tokens."""
    E, W = shape.HV * shape.K * shape.V, shape.W
    T = B * W
    ops = {
        "verify": 4 * T * E,
        "commit_nW": 2 * B * W * E,
        "commit_n1": 2 * B * 1 * E,
        "snapshot": 4 * T * E,
        "folded": 2 * B * W * E + 4 * T * E,
        "fla": 4 * T * E,
        "fla_contig": 4 * T * E,
    }
    ops["native_engine"] = ops["snapshot"]
    ops["closed_form_verify"] = 2 * T * E
    ops["closed_form_folded"] = 2 * B * W * E + 2 * T * E
    phases = lazy_phases(W)
    ops["lazy"] = sum(2 * T * E + (2 * B * p * E if fold else 0) for p, fold in phases) / len(phases)
    return ops


def kernel_stats(us: float, nbytes: int, ops: int, copy: dict, fma: dict, how: str) -> dict:
    """One kernel's entry: time, bytes, ops, bandwidth fraction and roofline fraction
    (:data:`OPS_MODEL`'s ``roofline``)."""
    gbps = nbytes / us / 1e3
    mem_us = nbytes / (copy["gbps"] * 1e3)
    ops_us = ops / (fma["tops"] * 1e6)
    floor = max(mem_us, ops_us)
    return {"time_us": us, "bytes": nbytes, "gbps": gbps, "frac_copy_bw": gbps / copy["gbps"],
            "ops": ops, "floor_mem_us": mem_us, "floor_ops_us": ops_us, "floor_us": floor,
            "frac_roofline": floor / us, "bound": "memory" if mem_us >= ops_us else "compute",
            "timing": how}


def ring_memory(shape: Shape, W: int) -> dict:
    """The lazy commit's records per slot as a fraction of one fp32 state, for max_pending
    L = 4, 8, 16: ``pending`` (the L records a slot keeps) and ``ring`` (the positions it
    allocates, ``max(L, W) + W``)."""
    from ssm_spec.ops.gdn.closed_form import ring_positions

    state = shape.HV * shape.K * shape.V * 4
    tok = shape.record_bytes_per_token
    return {L: {"pending": L * tok / state, "ring": ring_positions(L, W) * tok / state} for L in (4, 8, 16)}


# ----------------------------------------------------------------------------- ceilings


def copy_bandwidth(timer: Timer, nbytes: int, device: torch.device) -> dict:
    """Device-to-device ``dst.copy_(src)`` of ``nbytes``; bytes moved = read + write."""
    n = nbytes // 4
    src = torch.randn(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = timer.time_fn(lambda: dst.copy_(src))
    moved = 2 * src.nbytes
    return {"bytes": moved, "time_us": us, "gbps": moved / us / 1e3}


if triton is not None:
    @triton.jit
    def fma_kernel(x_ptr, y_ptr, n, a, b, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        """``FMA_CHAINS`` independent chains of ``ITERS`` fp32 FMAs per element (runtime ``a``,
        ``b``: nothing folds); one load and one store per element."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x0 = tl.load(x_ptr + offs, mask=m, other=0.0)
        x1 = x0 + 1.0
        x2 = x0 + 2.0
        x3 = x0 + 3.0
        for _ in range(ITERS):
            x0 = tl.fma(x0, a, b)
            x1 = tl.fma(x1, a, b)
            x2 = tl.fma(x2, a, b)
            x3 = tl.fma(x3, a, b)
        tl.store(y_ptr + offs, (x0 + x1) + (x2 + x3), mask=m)


def fma_rate(timer: Timer, nbytes: int, iters: int, device: torch.device) -> dict:
    """The fp32 arithmetic ceiling: ops/s of a plain FMA kernel on ``nbytes`` of fp32 data.
    CUDA: :func:`fma_kernel` (Triton); CPU: ``iters`` in-place ``torch.addcmul`` passes on one
    thread."""
    n = max(1, nbytes // 4)
    x = torch.rand(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    if device.type == "cuda":
        block = 1024
        grid = (triton.cdiv(n, block),)

        def fn():
            fma_kernel[grid](x, y, n, 0.999, 0.001, ITERS=iters, BLOCK=block, num_warps=4)

        ops, impl = n * iters * FMA_CHAINS, f"triton, {FMA_CHAINS} chains"
    else:  # one thread: a smoke-test number, free of thread-pool wake-up costs
        a, b = torch.full_like(x, 0.999), torch.full_like(x, 0.001)

        def fn():
            torch.addcmul(b, x, a, out=y)
            for _ in range(iters - 1):
                torch.addcmul(b, y, a, out=y)

        ops, impl = n * iters, "torch.addcmul, 1 thread"
    threads = torch.get_num_threads()
    if device.type != "cuda":
        torch.set_num_threads(1)
    try:
        us = timer.time_fn(fn)
    finally:
        torch.set_num_threads(threads)
    tops = ops / us / 1e6
    return {"elements": n, "iters": iters, "impl": impl, "ops": ops, "time_us": us,
            "tops": tops, "tflops": 2 * tops}
