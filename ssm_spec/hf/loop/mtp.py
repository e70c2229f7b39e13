"""The checkpoint's own MTP head as the decode loop's drafter, every step on the device
(docs/design.md section 7.8).

Columns are the loop's (:mod:`.rows`): row ``b``'s token ``x[c]`` sits at column ``c``, the
target's hidden state after its final norm there is ``h[c]``. The head's pair at column ``c``
is ``(h[c], x[c + 1])``, at the rotary position ``c - pad[b]`` of ``h[c]``, and predicts
``x[c + 2]`` (vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` and its MTP proposer: the token
ids shifted by one, the positions kept). The head's attention layer keeps its keys and values in
its own ``[B, kv_heads, capacity, head_dim]`` buffers at those columns
(:class:`~ssm_spec.hf.loop.cache.RowAttentionLayer`), so a row's buffer columns ``pad .. c``
are the pairs a query at column ``c`` attends to.

With the row's last generated token at column ``L``, the drafter holds ``g``, the head's output
for the pair at ``L - 1`` (``(h[L - 1], x[L])``), in a fixed ``[B, H]`` buffer. A round:

* ``propose``: draft ``d_1`` from ``lm_head(g)``; for ``j = 1 .. k - 1`` the pair
  ``(g, d_j)`` at column ``L - 1 + j`` (its output the next ``g``) gives ``d_{j + 1}``. Step
  ``j`` runs layer ``j mod num_layers``, as vLLM's proposer does.
* The target verifies ``[x[L], d_1 .. d_k]`` at columns ``L .. L + k`` and returns its hidden
  states there; it keeps ``a`` drafts and a bonus token.
* ``accept``: the head runs once over the ``k + 1`` pairs ``(h[c], x[c + 1])`` at columns
  ``L .. L + k`` with the target's hidden states (layer 0), overwriting what the draft steps
  wrote at those columns: the pairs up to ``L + a`` are the newly kept positions, those after
  it are past the row's end and are overwritten before any query can attend to them (a query
  at column ``q`` attends to columns up to ``q`` only, and every round rewrites the columns from
  its ``L`` on). That is the rollback: nothing is copied, the accepted prefix is recomputed
  from the target's hidden states as vLLM recomputes it. ``g`` becomes the output at column
  ``L + a``, the new last kept pair.

``start`` runs the head over the prompt's pairs at columns ``0 .. P - 1`` (the first generated
token at column ``P``), from the prefill's hidden states. Fixed shapes and no host reads, so a
round captures into a CUDA graph with the rest of the loop.
"""

from __future__ import annotations

import torch

from .accept import draw
from .cache import RowAttentionLayer
from .forward import compiled, row_mask

__all__ = ["MTPDrafter", "HeadKV"]


class HeadKV:
    """The MTP head's keys and values: one :class:`~ssm_spec.hf.loop.cache.RowAttentionLayer` of
    ``[B, kv_heads, capacity, head_dim]`` buffers per MTP layer, allocated up front, written at
    the columns set before each application (what the head's attention calls as its cache:
    ``update(keys, values, layer_idx, ...)``)."""

    def __init__(self, head, batch_size: int, capacity: int, device, dtype):
        attn = head.layers[0].self_attn
        self.layers = [RowAttentionLayer(capacity) for _ in range(head.num_layers)]
        for layer in self.layers:
            layer.allocate(int(batch_size), attn.config.num_key_value_heads, attn.head_dim, dtype, device)

    def set_columns(self, columns: torch.Tensor) -> None:
        for layer in self.layers:
            layer.columns = columns

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)


class MTPDrafter:
    """Drafts ``k`` tokens per round with the target checkpoint's MTP head (module docstring).

    Args:
        model: the converted target (its embeddings, LM head and rotary embedding are used).
        head: an :class:`~ssm_spec.hf.mtp.MTPHead` on the target's device and dtype
            (:func:`~ssm_spec.hf.mtp.load_mtp_head`).
        num_tokens: ``k`` (``num_assistant_tokens``).
        batch_size / capacity: the bucket's.
        scoring: the round's :class:`~ssm_spec.hf.loop.accept.Scoring` (drafts are chosen from
            scores processed as the target's are).
        sampling: draw drafts from the head's distribution (kept for rejection sampling)
            instead of taking its argmax.
        compile: the head's applications inside a round (the draft steps, the pass over the
            window) through ``torch.compile(fullgraph=True, dynamic=False)``, as the target's
            verify forward (:func:`~ssm_spec.hf.loop.forward.compiled`); the pass over the
            prompt stays eager.

    Raises:
        ValueError: ``num_tokens`` below 1.
    """

    #: the loop hands this drafter the target's hidden states (``start`` / ``accept``)
    needs_hidden = True

    def __init__(self, model, head, num_tokens: int, batch_size: int, capacity: int, scoring, sampling: bool,
                 compile: bool = False):
        from ..mtp import text_decoder

        self.k = int(num_tokens)
        if self.k < 1:
            raise ValueError(f"MTP drafter: num_assistant_tokens={num_tokens}; expected >= 1")
        self.head, self.scoring, self.sampling = head, scoring, sampling
        self.needs_probs = sampling
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.rotary = text_decoder(model).rotary_emb
        self.mrope = hasattr(self.rotary, "mrope_section")  # Qwen3.5: [3, B, L] positions (text: all equal)
        weight = self.embed.weight
        self.dtype, device = weight.dtype, weight.device
        self.sdpa = (getattr(model.config, "_attn_implementation", None) or "eager") == "sdpa"
        self.kv = HeadKV(head, batch_size, capacity, device, self.dtype)
        self._arange = torch.arange(int(capacity), device=device)
        self._g = torch.zeros(int(batch_size), weight.shape[1], dtype=self.dtype, device=device)
        self._rows = None
        self._columns = None
        self.compiles = bool(compile)
        # a function of (self, ...): a bound method kept on self would be a reference cycle
        self._apply_in_round = compiled(MTPDrafter._apply) if compile else MTPDrafter._apply

    def key(self) -> tuple:
        return ("mtp", id(self.head), self.k, self.sampling)

    def _apply(self, hidden: torch.Tensor, tokens: torch.Tensor, columns: torch.Tensor, pad: torch.Tensor,
               step: int) -> torch.Tensor:
        """The head over the pairs ``(hidden [B, L, H], tokens [B, L])`` at ``columns [B, L]``."""
        B, L = columns.shape
        self.kv.set_columns(columns)
        positions = columns - pad[:, None]
        rotary = self.rotary(hidden, positions[None].expand(3, B, L) if self.mrope else positions)
        mask = row_mask(self._arange, columns, pad, self.sdpa, self.dtype)
        return self.head(self.embed(tokens), hidden, rotary, mask, positions, self.kv, step)

    def start(self, rows, width: int, hidden: torch.Tensor) -> None:
        """After the prompt (columns ``0 .. P - 1``, the first new token at ``P``): the head over
        the prompt's pairs, from the prefill's hidden states ``hidden [B, P, H]`` (``width``:
        ``P - 1``, as an assistant's start gets it)."""
        self._rows = rows
        B, P = hidden.shape[:2]
        columns = rows.columns[:P][None, :].expand(B, P)
        out = self._apply(hidden, rows.tokens[:, 1:P + 1], columns, rows.pad, 0)
        self._g.copy_(out[:, -1])

    def propose(self, rows):
        """``(drafts [B, k] int64, num_drafts [B], probs [B, k, V] or None)``."""
        self._rows = rows
        self._columns = columns = rows.window_columns(self.k + 1)  # L .. L + k: the verify window's
        g = self._g
        drafts, probs = [], []
        for j in range(self.k):
            scores = self.scoring(self.lm_head(g)[:, None], rows, offset=j)[:, 0]
            if self.sampling:
                p = torch.softmax(scores, dim=-1)
                d = draw(p)
                probs.append(p)
            else:
                d = scores.argmax(dim=-1)
            drafts.append(d)
            if j + 1 < self.k:  # the pair (g, d_{j+1}) at column L + j (layer j + 1 mod the head's layers)
                g = self._apply_in_round(self, g[:, None], d[:, None], columns[:, j:j + 1], rows.pad,
                                         (j + 1) % self.head.num_layers)[:, 0]
        count = torch.full((rows.batch_size,), self.k, dtype=torch.int64, device=rows.device)
        return torch.stack(drafts, dim=1), count, torch.stack(probs, dim=1) if self.sampling else None

    def accept(self, accepted: torch.Tensor, active: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target kept ``accepted [B]`` drafts (and a bonus token) of each row's window, whose
        hidden states are ``hidden [B, k + 1, H]``: the head over the window's pairs, keeping the
        output at the last kept one."""
        rows, columns = self._rows, self._columns
        nxt = rows.tokens.gather(1, (columns + 1).clamp_max(rows.capacity - 1))
        out = self._apply_in_round(self, hidden, nxt, columns, rows.pad, 0)
        last = accepted.clamp(0, self.k)[:, None, None].expand(-1, 1, out.shape[-1])
        self._g.copy_(out.gather(1, last)[:, 0])
