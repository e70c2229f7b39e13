"""The verify step as a ``torch.export`` program (for torch.export and Torch-TensorRT).

The modules' engine forward takes a metadata object and a pool; an exported program needs
tensors in and tensors out. :class:`VerifyForward` is the verify path of a stack of
:class:`~ssm_spec.RecoverGatedDeltaNet` / :class:`~ssm_spec.RecoverShortConv` layers with the
pool's state tensors, the slots and ``query_start_loc`` as inputs, and the layer output plus
every layer's replay record as outputs. It runs the functional verify ops
(:mod:`ssm_spec.ops.functional`), so each appears in the exported graph as one node and
nothing is mutated; the caller then commits with the records it returned
(:func:`ssm_spec.ops.gdn_commit`, :func:`ssm_spec.ops.short_conv_commit`, in PyTorch).

:func:`export_verify` exports it with a dynamic token dim ``T`` and batch dim ``B`` (strict or
non-strict tracing).
"""

from __future__ import annotations

import torch
from torch import nn

from .modules import RecoverGatedDeltaNet, RecoverShortConv
from .ops import ReplayRecord, gdn_commit, short_conv_commit

__all__ = ["VerifyForward", "export_verify", "example_inputs", "commit_records"]


class VerifyForward(nn.Module):
    """The verify forward of a residual stack of GDN and short-conv layers, tensors only.

    ``forward(hidden [T, hidden], gdn_states, conv_states, state_indices [B] int32,
    query_start_loc [B + 1] int32)`` with ``gdn_states`` one ``[S, HV, K, V]`` pool per GDN layer
    and ``conv_states`` one ``[S, Lc, C]`` pool per conv state (each GDN layer's qkv conv, then
    each ``RecoverShortConv``, in layer order), returns ``(hidden_out [T, hidden], records)``
    where ``records`` lists, per layer in order, ``(u, k, decay, conv_x)`` for a GDN layer
    and ``(x,)`` for a short conv. Each layer adds its output to the residual stream
    (``x + layer(x)``). Tokens outside every window come out of every layer as 0.

    Unlike the modules' step it zeroes no state: a fresh request's slots must hold zeros
    before its first verify (prefill runs through the modules, or the engine zeroes slots it
    admits).

    Args:
        layers: the stack's ``RecoverGatedDeltaNet`` / ``RecoverShortConv`` modules (their
            parameters are shared, not copied).

    Raises:
        ValueError: a layer of another type.
    """

    def __init__(self, layers):
        super().__init__()
        layers = list(layers) if isinstance(layers, (list, tuple, nn.ModuleList)) else [layers]
        for layer in layers:
            if not isinstance(layer, (RecoverGatedDeltaNet, RecoverShortConv)):
                raise ValueError(f"VerifyForward: got a {type(layer).__name__}; expected RecoverGatedDeltaNet or "
                                 "RecoverShortConv layers")
        self.layers = nn.ModuleList(layers)

    @staticmethod
    def _gdn(layer: RecoverGatedDeltaNet, x, state, conv_state, slots, qsl):
        """The layer's own forward (projections, gates, output) around the functional verify ops."""
        mixed, z, b, a = layer.project(x)
        conv_out, rec_x = torch.ops.ssm_spec.short_conv_verify_functional(
            mixed, layer.conv1d.weight[:, 0], layer.conv1d.bias, conv_state, slots, qsl, 1, "silu")
        core, u, khat, decay = torch.ops.ssm_spec.gdn_verify_functional(
            *layer.gates(conv_out, a, b), state, slots, qsl, layer.head_k_dim**-0.5, True)
        return layer.output(core, z), (u, khat, decay, rec_x)

    def forward(self, hidden: torch.Tensor, gdn_states: list[torch.Tensor], conv_states: list[torch.Tensor],
                state_indices: torch.Tensor, query_start_loc: torch.Tensor):
        records = []
        gi = ci = 0
        x = hidden
        for layer in self.layers:
            if isinstance(layer, RecoverGatedDeltaNet):
                y, rec = self._gdn(layer, x, gdn_states[gi], conv_states[ci], state_indices, query_start_loc)
                gi, ci = gi + 1, ci + 1
            else:
                y, rec_x = torch.ops.ssm_spec.short_conv_verify_functional(
                    x, layer.weight[:, 0], layer.bias, conv_states[ci], state_indices, query_start_loc,
                    layer.dilation, layer.activation)
                rec, ci = (rec_x,), ci + 1
            x = x + y
            records.append(rec)
        return x, records


def example_inputs(module: VerifyForward, num_slots: int, lengths, device=None, dtype=torch.float32, seed=0):
    """Random inputs for ``module``: a hidden state for ``sum(lengths)`` tokens, fresh random
    pools of ``num_slots`` slots, rows on slots ``0..B-1`` with windows of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    gdn, conv = [], []
    hidden_size = None
    for layer in module.layers:
        if isinstance(layer, RecoverGatedDeltaNet):
            hidden_size = layer.hidden_size
        else:
            hidden_size = hidden_size or layer.channels
        for kind, spec in layer.state_specs():  # the pool's own shapes, GDN state before conv state
            if kind == "gdn":
                gdn.append(torch.randn(num_slots, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim, generator=gen))
            else:
                conv.append(torch.randn(num_slots, spec.state_len, spec.channels, generator=gen))
    T = sum(lengths)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    hidden = torch.randn(T, hidden_size, generator=gen).to(dtype)
    slots = torch.arange(len(lengths), dtype=torch.int32)
    move = lambda t: t.to(device)  # noqa: E731
    return (move(hidden), [move(s) for s in gdn], [move(s) for s in conv], move(slots), move(qsl))


def export_verify(module: VerifyForward, args, *, strict: bool = False, dynamic: bool = True):
    """``torch.export.export`` of ``module`` on ``args`` (as :func:`example_inputs` builds
    them), with the token dim ``T``, the batch dim ``B`` (``query_start_loc`` has ``B + 1``
    entries) and the pools' slot count ``S`` dynamic, each from 1 up, unless ``dynamic=False``.
    The example should have ``T, B, S >= 2`` (torch.export specialises sizes 0 and 1 of an
    example).

    Returns:
        the ``torch.export.ExportedProgram``; ``.module()`` runs it.

    Raises:
        whatever ``torch.export`` raises for a module it cannot trace.
    """
    shapes = None
    if dynamic:
        T = torch.export.Dim("T", min=1)
        B = torch.export.Dim("B", min=1)
        S = torch.export.Dim("S", min=1)  # every pool has the same slot count
        hidden, gdn, conv, _, _ = args
        shapes = ({0: T}, [{0: S}] * len(gdn), [{0: S}] * len(conv), {0: B}, {0: B + 1})
    return torch.export.export(module, tuple(args), dynamic_shapes=shapes, strict=strict)


def commit_records(module: VerifyForward, records, gdn_states, conv_states, query_start_loc, state_indices,
                   num_accepted_tokens, validate=None) -> None:
    """Commit what a :class:`VerifyForward` (or its exported program) returned: every layer's
    accepted tokens into ``gdn_states`` / ``conv_states`` (the same lists, in place), with
    :func:`ssm_spec.ops.gdn_commit` and :func:`ssm_spec.ops.short_conv_commit` (``dst = src``).

    Args:
        module: the verify module (its layer order gives each record's meaning).
        records: the second output of the verify.
        gdn_states, conv_states, query_start_loc, state_indices: the verify's inputs.
        num_accepted_tokens: ``[B]`` int32, ``0 <= n <= window length`` per row.
        validate: the ops' host-side checks (``None``: on in eager).

    Raises:
        ValueError: what the commit ops raise; nothing of that op is written.
    """
    gi = ci = 0
    for layer, rec in zip(module.layers, records):
        if isinstance(layer, RecoverGatedDeltaNet):
            gdn_commit(gdn_states[gi], ReplayRecord(*rec[:3]), query_start_loc, state_indices, num_accepted_tokens,
                       validate=validate)
            short_conv_commit(conv_states[ci], rec[3], query_start_loc, state_indices, num_accepted_tokens,
                              validate=validate)
            gi, ci = gi + 1, ci + 1
        else:
            short_conv_commit(conv_states[ci], rec[0], query_start_loc, state_indices, num_accepted_tokens,
                              validate=validate)
            ci += 1
