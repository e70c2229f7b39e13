"""Linears that read the same input run as one GEMM, under their own names.

A decode step at batch 1 reads every weight once, and a GEMM of one row costs about its launch
when the weight is small: Qwen3.5's GatedDeltaNet has four input projections (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``; the last two 32 or 48 columns wide), Qwen3-Next's two
(``in_proj_qkvz``, ``in_proj_ba``), attention three (``q_proj``, ``k_proj``, ``v_proj``) and each
MLP two (``gate_proj``, ``up_proj``). :func:`fuse_shared_input_linears` concatenates each such
group's weights into one tensor (a non-persistent buffer of the group's first member) and makes
every member's ``weight`` (and ``bias``) a view of its rows: the parameters keep their objects,
names and values, ``state_dict`` and ``save_pretrained`` write what they wrote before
(transformers clones disjoint views of one storage on save), and no weight is held twice.

The members stay ``nn.Linear`` (their class becomes the subclass :class:`SharedInputLinear`):
the first member called on an input computes the whole group's GEMM and leaves each other
member its columns, which that member returns when it is called on the same tensor (checked by
identity; called on another tensor it runs its own GEMM). The owning module's forward is not
touched, so the same grouping serves transformers' attention and MLP classes and ssm-spec's
GatedDeltaNet, eagerly, under ``torch.compile(fullgraph=True)`` and inside CUDA graphs.

A fused group's outputs are column slices of one ``[..., N_total]`` tensor: contiguous in their
last dimension, so ``view`` splitting that dimension (what the owners do) works; merging it with
another does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SharedInputLinear", "fuse_shared_input_linears", "unfuse_shared_input_linears",
           "fused_groups", "plain_resident_linear", "SHARED_INPUT_GROUPS"]

#: Names of sibling linears that read one input, per owner (attention, MLP, the two GDN layouts).
SHARED_INPUT_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkvz", "in_proj_ba"),
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
)


class SharedInputLinear(nn.Linear):
    """An ``nn.Linear`` in a group fused by :func:`fuse_shared_input_linears`.

    ``forward(x [..., in_features]) -> [..., out_features]`` (same dtype as the weight): the
    columns the group's fused GEMM left for this member if it ran on this very ``x``, else the
    fused GEMM now (leaving the other members theirs). Results equal ``nn.Linear``'s within
    the GEMM's rounding (one GEMM over all the group's rows instead of one per member).
    """

    _fused_group: tuple  # (leader,): the member holding the fused weight (a tuple: not a submodule)
    _fused_index: int
    _pending: tuple | None  # (input, output) the leader's GEMM left for this member

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending = self._pending
        if pending is not None:
            self._pending = None
            if pending[0] is x:
                return pending[1]
        leader = self._fused_group[0]
        if not torch.compiler.is_compiling() and not _placed(leader):
            if not _can_place(leader):  # weights moved in one module at a time (an accelerate offload hook)
                return F.linear(x, self.weight, self.bias)
            _place(leader)  # after model.to(...): fuse the moved weights again
        outs = F.linear(x, leader._fused_weight, leader._fused_bias).split(leader._fused_sizes, dim=-1)
        for member, out in zip(leader._fused_members, outs):
            if member is not self:
                member._pending = (x, out)
        return outs[self._fused_index]


def plain_resident_linear(m) -> bool:
    """Whether ``m`` is a plain ``nn.Linear`` (not a subclass: quantized or already swapped) whose
    parameters are plain tensors (no tensor subclass such as DTensor or a quantized weight) off
    the ``meta`` device, without an accelerate hook of its own (which moves or offloads its
    weights and calls the forward it saw)."""
    if type(m) is not nn.Linear or getattr(m, "_hf_hook", None) is not None:
        return False
    return all(p is None or (type(p) is nn.Parameter and type(p.data) is torch.Tensor and p.device.type != "meta")
               for p in (m.weight, m.bias))


def _members(owner: nn.Module, names) -> list[nn.Linear] | None:
    """The group's linears when all are plain, resident ``nn.Linear`` on one device and dtype,
    reading inputs of one width, all with a bias or none; else ``None``."""
    members = [getattr(owner, n, None) for n in names]
    if not all(plain_resident_linear(m) for m in members):
        return None
    first = members[0].weight
    for m in members:
        for p in (m.weight, m.bias):
            if p is not None and (p.device != first.device or p.dtype != first.dtype):
                return None
        if m.in_features != members[0].in_features or (m.bias is None) != (members[0].bias is None):
            return None
    return members


def _place(leader: SharedInputLinear) -> None:
    """Concatenate the members' current weights (and biases) into the leader's buffers and point
    every member's parameters at their rows."""
    members = leader._fused_members
    weight = torch.cat([m.weight.detach() for m in members])
    bias = torch.cat([m.bias.detach() for m in members]) if members[0].bias is not None else None
    leader.register_buffer("_fused_weight", weight, persistent=False)
    leader.register_buffer("_fused_bias", bias, persistent=False)
    start = 0
    for m in members:
        rows = slice(start, start + m.out_features)
        m.weight.data = weight[rows]
        if bias is not None:
            m.bias.data = bias[rows]
        start += m.out_features


def _placed(leader: SharedInputLinear) -> bool:
    """Whether the members' parameters are still views of the fused weight. Checks the leader's
    weight only (one pointer comparison a call): ``model.to(...)`` and accelerate's dispatch
    replace every member's tensor."""
    weight = leader._fused_weight
    return leader.weight.device == weight.device and leader.weight.data_ptr() == weight.data_ptr()


def _can_place(leader: SharedInputLinear) -> bool:
    """Whether the members' current weights can be fused: all resident on one device, one dtype."""
    first = leader.weight
    return first.device.type != "meta" and all(
        p.device == first.device and p.dtype == first.dtype
        for m in leader._fused_members for p in (m.weight, m.bias) if p is not None)


def fuse_shared_input_linears(model: nn.Module, groups=SHARED_INPUT_GROUPS) -> int:
    """Fuse every group of sibling linears in ``groups`` found under ``model`` (in place).

    Args:
        model: any module tree; a module holding all of one group's names as direct
            ``nn.Linear`` children is fused, unless a member is a subclass (quantized or already
            fused), has weights on the ``meta`` device or of another device or dtype, a
            different ``in_features``, a bias where another has none, a tensor subclass
            (DTensor) or an accelerate hook of its own.
        groups: tuples of child names, first member first.

    Returns:
        The number of groups fused.
    """
    count = 0
    for owner in model.modules():
        for names in groups:
            members = _members(owner, names)
            if members is None:
                continue
            leader = members[0]
            for i, m in enumerate(members):
                m.__class__ = SharedInputLinear
                object.__setattr__(m, "_fused_group", (leader,))
                object.__setattr__(m, "_fused_index", i)
                object.__setattr__(m, "_pending", None)
            object.__setattr__(leader, "_fused_members", tuple(members))
            object.__setattr__(leader, "_fused_sizes", [m.out_features for m in members])
            _place(leader)
            count += 1
    return count


def fused_groups(model: nn.Module) -> list[tuple[SharedInputLinear, ...]]:
    """The fused groups under ``model``, each as its members (first the one holding the fused weight)."""
    return [m._fused_members for m in model.modules()
            if isinstance(m, SharedInputLinear) and m._fused_group[0] is m]


def unfuse_shared_input_linears(model: nn.Module) -> int:
    """Undo :func:`fuse_shared_input_linears`: every member gets a weight (and bias) of its own
    (a copy of its rows) and its class back; the fused buffers are dropped. Returns the number
    of groups undone."""
    groups = fused_groups(model)
    for members in groups:
        leader = members[0]
        for m in members:
            m.weight.data = m.weight.detach().clone()
            if m.bias is not None:
                m.bias.data = m.bias.detach().clone()
        del leader._buffers["_fused_weight"], leader._buffers["_fused_bias"]
        for m in members:
            for name in ("_fused_group", "_fused_index", "_pending", "_fused_members", "_fused_sizes"):
                m.__dict__.pop(name, None)
            m.__class__ = nn.Linear
    return len(groups)
