"""Host-side validation shared by every op (docs/design.md section 3.5, "Validation").

Two levels:

* structural checks (ranks, shapes, dtypes, devices): cheap, no host sync; the op kernels run
  them on every call so that no kernel is launched with shapes that would index out of
  bounds;
* value checks (slot ranges, window bounds, accepted counts, write conflicts): read the index
  tensors on the host; the Python wrappers run them when ``validate`` is on (the default in
  eager mode, off while compiling or capturing).

Every failure is a ``ValueError`` that names the op, the argument, what it got and what was
expected, raised before anything is written.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence

import torch

NULL_SLOT = -1
"""Any slot index ``< 0`` means "none" (docs/design.md section 3.1)."""

INDEX_DTYPE = torch.int32


def should_validate(validate: bool | None, op: str = "ssm_spec") -> bool:
    """Resolve ``validate=None`` to "on in eager, off while compiling or capturing".

    Raises:
        ValueError: ``validate=True`` inside ``torch.compile`` or a CUDA graph capture (the
            value checks read the metadata on the host, which neither allows).
    """
    # is_compiling first: dynamo (torch 2.11) cannot trace the capture query
    busy = torch.compiler.is_compiling() or (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    if validate is None:
        return not busy
    if validate and busy:
        fail(op, "validate", True, "None or False while compiling or capturing (validation reads "
             "the metadata on the host; validate the step's metadata once, outside)")
    return bool(validate)


def check_scalars(op: str, *, scale=None, use_qk_l2norm=None, dilation=None, activation=None) -> None:
    """Static (non-tensor) arguments: a finite float scale, a bool, an int dilation >= 1."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        fail(op, "scale", repr(scale), "a finite float (or None for K ** -0.5)")
    if use_qk_l2norm is not None and not isinstance(use_qk_l2norm, bool):
        fail(op, "use_qk_l2norm", repr(use_qk_l2norm), "a bool")
    if dilation is not None and (isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1):
        fail(op, "dilation", repr(dilation), "an int >= 1")
    if activation is not None and activation not in ("silu", "none"):
        fail(op, "activation", repr(activation), "'silu' or 'none'")


def check_no_grad(op: str, **tensors) -> None:
    """The ops have no autograd formula: refuse inputs that require grad while grad mode is
    on, rather than return outputs silently detached from the graph."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            fail(op, name, "a tensor that requires grad", "no autograd (run under torch.no_grad() "
                 "or detach; the ops are inference kernels)")


def check_unaliased_pool(op: str, arg: str, pool: torch.Tensor) -> None:
    """A mutated pool must not alias itself (an ``expand``-ed pool would write every slot)."""
    for dim, (size, stride) in enumerate(zip(pool.shape, pool.stride())):
        if size > 1 and stride == 0:
            fail(op, arg, f"stride 0 in dim {dim} (an expanded or broadcast tensor)",
                 "a pool whose slots do not alias one another")


def fail(op: str, arg: str, got, expected) -> None:
    raise ValueError(f"{op}: {arg}: got {got}; expected {expected}")


def check_tensor(
    op: str,
    arg: str,
    t,
    *,
    shape: Sequence[int | None] | None = None,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> None:
    """Structural check of one tensor argument; ``None`` entries of ``shape`` match anything."""
    if not isinstance(t, torch.Tensor):
        fail(op, arg, type(t).__name__, "a torch.Tensor")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            fail(op, arg, f"a {t.dim()}-D tensor of shape {tuple(t.shape)}", f"{' or '.join(map(str, allowed))}-D")
    if shape is not None:
        ok = t.dim() == len(shape) and all(e is None or e == s for e, s in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            fail(op, arg, f"shape {list(t.shape)}", f"shape {want}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, arg, f"dtype {t.dtype}", " or ".join(map(str, dtypes)))
    if device is not None and t.device != device:
        fail(op, arg, f"device {t.device}", f"device {device} (the state's)")


def check_dims(op: str, dim: str, sizes: dict[str, tuple[int, Sequence[int]]]) -> int:
    """The size of dimension ``dim`` that every argument of ``sizes`` (``{argument: (its size
    of ``dim``, its shape)}``) holds, so that an argument that disagrees is the one named.

    Raises:
        ValueError: the arguments disagree: naming the one whose size differs from a strict
            majority's, or every argument where no size has one (two arguments, say).
    """
    values = [size for size, _ in sizes.values()]
    if len(set(values)) <= 1:
        return values[0]
    common, count = Counter(values).most_common(1)[0]
    if 2 * count > len(values):
        arg, (size, shape) = next((a, e) for a, e in sizes.items() if e[0] != common)
        holders = ", ".join(a for a, (n, _) in sizes.items() if n == common)
        fail(op, arg, f"{dim} = {size} (shape {list(shape)})", f"{dim} = {common}, as in {holders}")
    listing = ", ".join(f"{dim} = {size} in {arg} (shape {list(shape)})" for arg, (size, shape) in sizes.items())
    raise ValueError(f"{op}: {', '.join(sizes)}: got {listing}; expected one {dim}")


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def check_index(op: str, arg: str, t, length: int | None, device, ndim: int = 1) -> None:
    """An int32 index tensor of ``ndim`` dims whose first dim is ``length`` (any strides)."""
    check_tensor(op, arg, t, ndim=ndim, dtypes=(INDEX_DTYPE,), device=device)
    if length is not None and t.shape[0] != length:
        fail(op, arg, f"shape {list(t.shape)}",
             f"first dim {length} (one entry per row: len(query_start_loc) - 1)")


# ----------------------------------------------------------------------------- values


def window_bounds(op: str, query_start_loc: torch.Tensor, num_tokens: int) -> list[tuple[int, int]]:
    """Check ``query_start_loc`` values and return the windows ``[(bos, eos)]``."""
    qsl = query_start_loc.tolist()
    if qsl and qsl[0] < 0:
        fail(op, "query_start_loc[0]", qsl[0], ">= 0")
    for b in range(len(qsl) - 1):
        if qsl[b + 1] < qsl[b]:
            fail(op, f"query_start_loc[{b + 1}]", qsl[b + 1], f">= query_start_loc[{b}] = {qsl[b]} (non-decreasing)")
    if qsl and qsl[-1] > num_tokens:
        fail(op, "query_start_loc[-1]", qsl[-1], f"<= {num_tokens} (the token dim of the activations)")
    return [(qsl[b], qsl[b + 1]) for b in range(len(qsl) - 1)]


def slot_values(op: str, arg: str, t: torch.Tensor, num_slots: int) -> list:
    """Check that every entry is ``< num_slots`` (``< 0`` is the null slot) and return them."""
    vals = t.tolist()
    flat = [x for row in vals for x in row] if t.dim() == 2 else vals
    for i, s in enumerate(flat):
        if s >= num_slots:
            where = f"{arg}[{i // t.shape[1]}, {i % t.shape[1]}]" if t.dim() == 2 else f"{arg}[{i}]"
            fail(op, where, s, f"a slot < {num_slots} (the pool's slot count) or < 0 for none")
    return vals


def log_decay_values(op: str, g: torch.Tensor, windows: list[tuple[int, int]], slots: list[int]) -> None:
    """Check ``g <= 0`` (a log decay; NaN fails too) on every token of a live row's window
    (``slots[b] >= 0``); tokens outside them are never read and may hold anything. Reads back
    only the tokens that fail (one host sync)."""
    bad = (~(g <= 0)).any(dim=-1).nonzero().flatten().tolist()
    starts = [bos for bos, _ in windows]
    for t in bad:
        b = bisect_right(starts, t) - 1  # windows are contiguous, in row order
        if b >= 0 and t < windows[b][1] and slots[b] >= 0:
            h = int((~(g[t] <= 0)).nonzero()[0])
            fail(op, f"g[{t}, {h}]", g[t, h].item(), "<= 0 (a log decay: the state decays by exp(g) <= 1)")


def count_values(op: str, t: torch.Tensor, windows: list[tuple[int, int]]) -> list[int]:
    """Check ``0 <= num_accepted_tokens[b] <= window length`` and return the counts."""
    vals = t.tolist()
    for b, (n, (bos, eos)) in enumerate(zip(vals, windows)):
        if not 0 <= n <= eos - bos:
            fail(op, f"num_accepted_tokens[{b}]", n, f"0 <= n <= {eos - bos} (the row's window length)")
    return vals


def check_write_conflicts(op: str, reads: dict[int, int], writes: list[tuple[int, int, str]],
                          note: str = "") -> None:
    """Reject two rows writing one slot and a row writing another row's source slot.

    Args:
        reads: ``{row: source slot}`` for rows that read a slot.
        writes: ``(row, slot, argument name)`` for every slot a row will write.
        note: appended to the message (why the named argument is written).
    """
    owner: dict[int, tuple[int, str]] = {}
    for row, slot, arg in writes:
        prev = owner.get(slot)
        if prev is not None and prev[0] != row:
            fail(op, arg, f"slot {slot}",
                 f"a slot no other row writes (already written by row {prev[0]} via {prev[1]}){note}")
        owner[slot] = (row, arg)
    readers = {}
    for row, slot in reads.items():
        readers.setdefault(slot, []).append(row)
    for row, slot, arg in writes:
        others = [r for r in readers.get(slot, ()) if r != row]
        if others:
            fail(op, arg, f"slot {slot}", f"not the source slot of another row (row {others[0]} reads it){note}")


# ----------------------------------------------------------------------------- commits


def check_commit_metadata(op, device, query_start_loc, src_indices, num_accepted_tokens,
                          dst_indices, boundary_indices, boundary_offsets) -> None:
    """Structural checks of a commit's per-row metadata (shared by both commits)."""
    check_index(op, "query_start_loc", query_start_loc, None, device)
    B = query_start_loc.shape[0] - 1
    if B < 0:
        raise ValueError(f"{op}: query_start_loc: got an empty tensor; expected [B + 1] entries")
    check_index(op, "src_indices", src_indices, B, device)
    check_index(op, "num_accepted_tokens", num_accepted_tokens, B, device)
    check_index(op, "dst_indices", dst_indices, B, device)
    check_index(op, "boundary_indices", boundary_indices, B, device, ndim=2)
    check_index(op, "boundary_offsets", boundary_offsets, B, device, ndim=2)
    if boundary_offsets.shape != boundary_indices.shape:
        raise ValueError(f"{op}: boundary_offsets: got shape {list(boundary_offsets.shape)}; "
                         f"expected the shape of boundary_indices {list(boundary_indices.shape)}")


def _offsets(windows: list[tuple[int, int]]):
    """The ``query_start_loc`` values of ``windows`` (for a message)."""
    return [bos for bos, _ in windows] + [windows[-1][1]] if windows else "no rows"


def no_boundaries(batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``[B, 0]`` int32 boundary index and offset tensors."""
    empty = torch.empty((batch, 0), dtype=torch.int32, device=device)
    return empty, empty


def commit_defaults(op, src_indices, dst_indices, boundary_indices, boundary_offsets):
    """Fill the commit wrappers' defaults: ``dst = src`` and no boundaries."""
    if not isinstance(src_indices, torch.Tensor) or src_indices.dim() != 1:
        fail(op, "src_indices", type(src_indices).__name__ if not isinstance(src_indices, torch.Tensor)
             else f"a {src_indices.dim()}-D tensor", "a 1-D int32 torch.Tensor, one slot per row")
    if dst_indices is None:
        dst_indices = src_indices
    if boundary_indices is None and boundary_offsets is None:
        boundary_indices, boundary_offsets = no_boundaries(src_indices.shape[0], src_indices.device)
    elif boundary_indices is None or boundary_offsets is None:
        raise ValueError(f"{op}: boundary_indices and boundary_offsets: got only one of them; "
                         "expected both or neither")
    return dst_indices, boundary_indices, boundary_offsets


def check_commit_values(op, num_slots, num_tokens, query_start_loc, src_indices,
                        num_accepted_tokens, dst_indices, boundary_indices, boundary_offsets, *,
                        dst_arg="dst_indices", made_with=None, record_arg="record"):
    """Value checks shared by the GDN and short-conv commits (host sync).

    ``dst_arg``: the argument that gave ``dst_indices`` (``src_indices`` where the caller left
    ``dst_indices`` out). ``made_with``: the windows the record ``record_arg`` was made with,
    where known (:mod:`ssm_spec.ops._layout`): a row that writes (a live source, a count
    above 0) must have its window there (a commit that writes nothing is not refused).
    """
    windows = window_bounds(op, query_start_loc, num_tokens)
    srcs = slot_values(op, "src_indices", src_indices, num_slots)
    counts = count_values(op, num_accepted_tokens, windows)
    if made_with is not None:
        for b, (window, src, n) in enumerate(zip(windows, srcs, counts)):
            if src >= 0 and n > 0 and (b >= len(made_with) or made_with[b] != window):
                there = f"[{made_with[b][0]}, {made_with[b][1]})" if b < len(made_with) else "no window"
                fail(op, "query_start_loc", f"{_offsets(windows)} (row {b}: tokens [{window[0]}, {window[1]}))",
                     f"{_offsets(made_with)}, the query_start_loc {record_arg} was made with (row {b}: {there}; a "
                     "commit replays the tokens of its verify's windows: pass that verify's query_start_loc)")
    dsts = slot_values(op, "dst_indices", dst_indices, num_slots)
    bidx = slot_values(op, "boundary_indices", boundary_indices, num_slots)
    boff = boundary_offsets.tolist()
    # every live row's checkpoint is protected, also that of a row accepting nothing
    reads = {b: s for b, s in enumerate(srcs) if s >= 0}
    writes = []
    for b in (b for b in reads if counts[b] > 0):
        for j, (idx, off) in enumerate(zip(bidx[b], boff[b])):
            if idx >= 0 and 1 <= off <= counts[b]:
                writes.append((b, idx, f"boundary_indices[{b}, {j}]"))
        if dsts[b] >= 0:
            writes.append((b, dsts[b], f"{dst_arg}[{b}]"))
    note = "; with dst_indices left out each row writes its source slot" if dst_arg != "dst_indices" else ""
    check_write_conflicts(op, reads, writes, note)
