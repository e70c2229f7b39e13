"""The settings of a converted model (:class:`RecoverSSMConfig`), kept apart from what the model
holds at run time (:class:`RecoverSSMRuntime`), and the public ways to read both.

:func:`~ssm_spec.hf.apply_recoverssm` validates its arguments once, here, and stores a frozen
config on the model; a later call replaces it with an updated copy. Everything else reads it
through :func:`recoverssm_config` and the kept cache's statistics through
:func:`acceptance_stats` / :func:`kept_cache`, never through the model's private attribute.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
from dataclasses import dataclass, field

import torch

from ..pools.protocols import MODES, STATE_DTYPES, check_mode, check_state_dtype

__all__ = ["RecoverSSMConfig", "RecoverSSMRuntime", "recoverssm_config", "kept_cache", "acceptance_stats",
           "is_converted", "cache_kwarg", "check_state_dtype", "check_mode", "STATE_DTYPES", "MODES",
           "DEFAULT_NUM_ASSISTANT_TOKENS"]

DEFAULT_NUM_ASSISTANT_TOKENS = 20  # transformers' default for num_assistant_tokens

@dataclass(frozen=True)
class RecoverSSMConfig:
    """What a converted model was asked to do; frozen and validated on construction.

    Attributes:
        state_dtype: recurrent state dtype of the caches ``generate`` creates
            (``torch.float32`` or ``torch.bfloat16``).
        mode: ``"exact"`` (tokens equal plain greedy in fp32) or ``"fast"`` (the closed-form
            verify, docs/design.md section 2.6).
        cuda_graphs: ``generate`` replays forwards (and the decode loop's rounds) from CUDA
            graphs on CUDA devices.
        decode_loop: ``generate`` runs ssm-spec's own decode loop (plain decoding, prompt lookup
            and assistants at any batch size, docs/design.md section 7.7) instead of
            transformers' loop, where the call's options allow it.
        compile: the decode loop's verify forwards, the MTP head's in-round steps and the
            round's integer bookkeeping (prompt lookup's search, the rows' append, the
            counters) run through ``torch.compile(fullgraph=True, dynamic=False)`` (one static
            graph per bucket and window width, compiled on its first call; what ``cuda_graphs``
            captures then is the compiled code): ``True``, ``False``, or ``"auto"`` (the
            default): when the loop captures CUDA graphs (``cuda_graphs`` on a CUDA device),
            else eager (:meth:`compiles_on`). An assistant's own ``"auto"`` follows the target
            loop it drafts for.
        fused_projections: linears that read the same input run as one GEMM (GDN's input
            projections, attention's q/k/v, each MLP's gate/up;
            :mod:`ssm_spec.hf.fused_linear`), and the projections back to the residual stream
            run as inductor's GEMV in a compiled one-row bf16/fp16 CUDA forward
            (:mod:`ssm_spec.hf.narrow_gemv`); parameter names, values and ``save_pretrained``
            unchanged.

    New switches are added as fields with defaults, so configs built by keyword stay valid;
    :meth:`replace` gives an updated copy (validated again).

    Raises:
        ValueError: a field outside its allowed values.
    """

    state_dtype: torch.dtype = torch.float32
    mode: str = "exact"
    cuda_graphs: bool = False
    decode_loop: bool = True
    compile: bool | str = "auto"
    fused_projections: bool = True

    def __post_init__(self):
        check_state_dtype("RecoverSSMConfig", self.state_dtype)
        check_mode("RecoverSSMConfig", self.mode)
        for name in ("cuda_graphs", "decode_loop", "fused_projections"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RecoverSSMConfig: {name}: got {getattr(self, name)!r}; expected True or False")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ValueError(f"RecoverSSMConfig: compile: got {self.compile!r}; expected True, False or 'auto'")

    def compiles_on(self, device) -> bool:
        """Whether the decode loop on ``device`` compiles its forwards: ``compile`` when set,
        else (``"auto"``) when it captures CUDA graphs there."""
        if self.compile == "auto":
            return self.cuda_graphs and torch.device(device).type == "cuda"
        return self.compile

    def replace(self, **changes) -> RecoverSSMConfig:
        """A copy with ``changes`` applied; ``None`` values keep the current setting."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


class KeptCache:
    """Holds a model's graphed cache between ``generate`` calls; a copy of the model (deepcopy)
    starts without one (CUDA graphs cannot be copied, and they point at the original's buffers)."""

    def __init__(self):
        self.cache = None
        self.made_for = None

    def __deepcopy__(self, memo):
        return KeptCache()


@dataclass
class RecoverSSMRuntime:
    """What a converted model holds at run time, beside its config (private to ``ssm_spec.hf``).

    Attributes:
        config: the :class:`RecoverSSMConfig`.
        cache_kwarg: the name transformers' ``forward`` takes the cache by (``cache`` or
            ``past_key_values``).
        kept: the graphed cache kept between ``generate`` calls (:class:`KeptCache`).
        experts_implementation: the model's own expert implementation while ``cuda_graphs``
            switched it (``None`` otherwise).
        last_stats: the :class:`~ssm_spec.hf.AcceptanceStats` of the last ``generate`` call
            (its cache's, or the decode loop's).
        loop / loop_key: the decode loop kept for the next call with the same key
            (:class:`~ssm_spec.hf.loop.DecodeLoop`), and that key.
        mtp: the checkpoint's MTP head (:class:`~ssm_spec.hf.mtp.MTPHead`) once loaded
            (``apply_recoverssm(model, mtp=...)``, or the first ``generate(use_mtp=True)``),
            else ``None``. Runtime data, not a setting: it holds modules; the target's
            embeddings and LM head are not in it (the drafter takes the model's).
    """

    config: RecoverSSMConfig
    cache_kwarg: str
    kept: KeptCache = field(default_factory=KeptCache)
    experts_implementation: object = None
    last_stats: object = None
    loop: object = None
    loop_key: object = None
    mtp: object = None

    def __deepcopy__(self, memo):
        """A copy of the model starts without kept caches or loops (they hold graphs and buffers
        of the original); it gets a copy of the MTP head."""
        return RecoverSSMRuntime(self.config, self.cache_kwarg, experts_implementation=self.experts_implementation,
                                 mtp=copy.deepcopy(self.mtp, memo))

    def drop_loop(self) -> None:
        """Forget the kept decode loop, freeing its buffers and graphs now (before a new loop makes
        its own): the loop holds no reference cycle, but a compiled forward's trace leaves some
        that reach its cache, so a loop that compiled anything is collected here."""
        loop, self.loop, self.loop_key = self.loop, None, None
        if loop is not None and loop.compiles:
            del loop
            gc.collect()

    def placed_mtp(self, device, dtype):
        """The MTP head, moved (in place) to ``device`` and ``dtype`` when the model moved since
        it was loaded."""
        head = self.mtp
        p = next(head.parameters())
        if p.device != torch.device(device) or p.dtype != dtype:
            head.to(device=device, dtype=dtype)
        return head


def is_converted(model) -> bool:
    """Whether :func:`~ssm_spec.hf.apply_recoverssm` has converted ``model``."""
    return isinstance(getattr(model, "_recoverssm", None), RecoverSSMRuntime)


def cache_kwarg(model) -> str:
    """The name transformers uses for the cache: ``cache`` (5.2x and later) or ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _runtime(model, caller: str) -> RecoverSSMRuntime:
    runtime = getattr(model, "_recoverssm", None)
    if not isinstance(runtime, RecoverSSMRuntime):
        raise ValueError(f"{caller}: {type(model).__name__} is not converted; call ssm_spec.hf.apply_recoverssm(model)")
    return runtime


def recoverssm_config(model) -> RecoverSSMConfig:
    """The :class:`RecoverSSMConfig` of a converted model.

    Raises:
        ValueError: ``model`` is not converted.
    """
    return _runtime(model, "recoverssm_config").config


def kept_cache(model):
    """The graphed :class:`~ssm_spec.hf.RecoverSSMCache` a ``cuda_graphs`` model keeps between
    ``generate`` calls (``None`` before the first such call, or with ``cuda_graphs`` off).

    Raises:
        ValueError: ``model`` is not converted.
    """
    return _runtime(model, "kept_cache").kept.cache


def acceptance_stats(model):
    """The :class:`~ssm_spec.hf.AcceptanceStats` of the cache the last ``generate`` call of a
    converted model used (the one it created, or the one passed in); ``None`` before any call
    and after a call that drafted nothing (plain decoding in ssm-spec's decode loop).

    Raises:
        ValueError: ``model`` is not converted.
    """
    return _runtime(model, "acceptance_stats").last_stats
