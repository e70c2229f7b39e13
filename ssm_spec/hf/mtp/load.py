"""Reading a checkpoint's ``mtp.*`` tensors into an :class:`~ssm_spec.hf.mtp.MTPHead`.

transformers does not load them: the Qwen3-Next / Qwen3.5 model classes list ``^mtp.*`` in
``_keys_to_ignore_on_load_unexpected``. They are read here with safetensors from the checkpoint
directory (one ``model.safetensors``, or shards named by ``model.safetensors.index.json``), every
tensor checked against the head's names and shapes before any is kept.

Layouts accepted for expert layers: transformers' fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
(gate rows first) and ``mlp.experts.down_proj`` ``[E, H, I]`` (the published Qwen3.5-MoE
checkpoints), or one tensor per expert, ``mlp.experts.N.{gate,up,down}_proj.weight`` (the
published Qwen3-Next checkpoints, and what ``save_pretrained`` writes), stacked into the fused
form as transformers' own conversion does (``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from .head import MTPHead, declared_layer_count, missing_layer_count, mtp_layer_count

__all__ = ["load_mtp_head", "checkpoint_path", "mtp_tensor_files", "PREFIX", "INDEX_FILE", "SINGLE_FILE"]

PREFIX = "mtp."
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _names(names, limit: int = 6) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def checkpoint_path(model: nn.Module) -> str:
    """The checkpoint a model was loaded from: ``model.name_or_path`` (transformers sets it, and
    ``config._name_or_path``, to the path or Hub id given to ``from_pretrained``).

    Raises:
        ValueError: the model has none (built in memory, not loaded).
    """
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not path:
        raise ValueError("MTP head: the model has no checkpoint path (its name_or_path is empty: built in memory, "
                         "not loaded with from_pretrained); pass the directory of a checkpoint with mtp.* weights: "
                         "apply_recoverssm(model, mtp=PATH)")
    return str(path)


@contextlib.contextmanager
def _opened(file: Path):
    """``safe_open`` of ``file`` on the CPU; what safetensors raises for a damaged or unreadable
    file (its own ``SafetensorError``, an ``OSError``), opening it or reading a tensor, becomes a
    ``ValueError`` naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' error type is not public API
        raise ValueError(f"MTP head: {file} cannot be read as safetensors weights "
                         f"({type(exc).__name__}: {exc})") from exc


def _hub_snapshot(name: str) -> Path | None:
    """The local Hugging Face cache snapshot of Hub id ``name`` (nothing is downloaded), or ``None``."""
    if name.count("/") != 1 or name.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache, or no huggingface_hub: the caller says where it looked
        return None


def mtp_tensor_files(path) -> tuple[str, dict[str, Path]]:
    """``(where, {tensor name: file})`` of the ``mtp.*`` tensors of a checkpoint.

    ``path``: a checkpoint directory (``model.safetensors.index.json`` or ``model.safetensors``
    in it), an index file, a ``.safetensors`` file, or a Hub id found in the local Hugging Face
    cache. ``where`` names what was read, for error messages.

    Raises:
        ValueError: no such file or directory (nor cached Hub id); a directory without
            safetensors weights; an index without a ``weight_map``; a file safetensors cannot read.
    """
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        snapshot = _hub_snapshot(os.fspath(path))
        if snapshot is None:
            raise ValueError(f"MTP head: {os.fspath(path)!r} is not a file or directory (nor a Hub id in the local "
                             "Hugging Face cache; nothing is downloaded): pass the checkpoint directory")
        p = snapshot
    if p.is_dir():
        if (p / INDEX_FILE).is_file():
            p = p / INDEX_FILE
        elif (p / SINGLE_FILE).is_file():
            p = p / SINGLE_FILE
        else:
            raise ValueError(f"MTP head: {p} holds neither {INDEX_FILE} nor {SINGLE_FILE} (the head is read from "
                             "safetensors weights)")
    if p.name.endswith(".json"):
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"MTP head: {p} is not a safetensors index (no weight_map): {exc}") from None
        files = {name: p.parent / file for name, file in weight_map.items() if name.startswith(PREFIX)}
        return str(p), files
    with _opened(p) as f:
        return str(p), {name: p for name in f.keys() if name.startswith(PREFIX)}


def _count_beside(where: str) -> int | None:
    """The MTP layer count the ``config.json`` beside the weights read (``where``, a file)
    declares, or ``None`` (no such file, or it declares none).

    Raises:
        ValueError: that file cannot be read as a JSON object; its count is not an integer or below 1.
    """
    config = Path(where).parent / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"MTP head: {config} cannot be read as a config ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"MTP head: {config} holds a JSON {type(data).__name__}, not a config object")
    return declared_layer_count(data, str(config))


def _read(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    out = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise ValueError(f"MTP head: the index names {file} for {_names(names)}, and it is missing")
        with _opened(file) as f:
            present = set(f.keys())
            absent = [n for n in names if n not in present]
            if absent:
                raise ValueError(f"MTP head: the index places {_names(absent)} in {file}, which does not hold them")
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def _fuse_experts(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Size], where: str):
    """Per-expert tensors (names without the prefix) stacked into transformers' fused layout."""
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for base, parts in groups.items():
        fused_gu, fused_d = f"{base}.gate_up_proj", f"{base}.down_proj"
        if fused_gu not in expected or fused_d not in expected:
            names = [f"{PREFIX}{base}.{e}.{kind}.weight" for e, kind in parts]
            raise ValueError(f"MTP head: {where} has per-expert tensors ({_names(names)}) where the model's MTP layer "
                             "has no expert layer")
        E, two_i, H = expected[fused_gu]
        inter = two_i // 2
        want = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
        missing = [f"{PREFIX}{base}.{e}.{kind}.weight" for e in range(E) for kind in want if (e, kind) not in parts]
        extra = [f"{PREFIX}{base}.{e}.{kind}.weight" for e, kind in parts if e >= E]
        if missing or extra:
            raise ValueError(f"MTP head: {where}: the model's MTP expert layer has {E} experts; "
                             + (f"missing {_names(missing)}" if missing else "")
                             + ("; " if missing and extra else "") + (f"unexpected {_names(extra)}" if extra else ""))
        bad = [f"{PREFIX}{base}.{e}.{kind}.weight {tuple(t.shape)} (the model needs {want[kind]})"
               for (e, kind), t in parts.items() if tuple(t.shape) != want[kind]]
        if bad:
            raise ValueError(f"MTP head: {where}: shapes that do not fit the model: {_names(bad, 4)}")
        out[fused_gu] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0)
                                     for e in range(E)])
        out[fused_d] = torch.stack([parts[(e, "down_proj")] for e in range(E)])
    return out


def load_mtp_head(model: nn.Module, path=None) -> MTPHead:
    """The MTP head of ``model``'s checkpoint, on the device and in the dtype of the model's
    embeddings, in eval mode without gradients.

    Args:
        model: a Qwen3-Next / Qwen3.5 model (converted or not; any of the classes of
            :func:`~ssm_spec.hf.apply_recoverssm`, the vision-language ones through their text
            model).
        path: where the ``mtp.*`` tensors are (:func:`mtp_tensor_files`); default the
            checkpoint the model was loaded from (:func:`checkpoint_path`). Where the model's
            config declares no MTP layer count, the ``config.json`` beside ``path``'s weights does.

    Returns:
        an :class:`~ssm_spec.hf.mtp.MTPHead` with the declared number of MTP layers. Nothing
        is changed on ``model``.

    Raises:
        ValueError: the MTP layer count missing, not an integer or below 1
            (``mtp_num_hidden_layers`` / ``num_nextn_predict_layers``); no checkpoint path, or
            nothing readable there (a damaged file named); no
            ``mtp.*`` tensors, or some missing (named, with the file looked at); unexpected
            ``mtp.*`` names; shapes that do not fit the model. Raised before anything is kept:
            a failed load leaves no head half-built.
    """
    count = declared_layer_count(model.config) if path is not None else mtp_layer_count(model)
    source = checkpoint_path(model) if path is None else path
    where, files = mtp_tensor_files(source)
    if count is None:  # the model's config has none: the checkpoint's own config.json, beside its weights
        count = _count_beside(where)
        if count is None:
            raise ValueError(missing_layer_count(model.config, f"{Path(where).parent / 'config.json'} beside the weights"))
    head = MTPHead.for_model(model, count)  # on meta: names and shapes only
    expected = {name: t.shape for name, t in head.state_dict().items()}
    if not files:
        raise ValueError(f"MTP head: no mtp.* tensors in {where} (the model's MTP head needs "
                         f"{_names(PREFIX + n for n in expected)}); the checkpoint carries no MTP weights")
    tensors = _fuse_experts({name[len(PREFIX):]: t for name, t in _read(files).items()}, expected, where)
    missing = [PREFIX + n for n in expected if n not in tensors]
    if missing:
        raise ValueError(f"MTP head: {where} lacks {_names(missing)} (of the {len(expected)} tensors of a "
                         f"{count}-layer head)")
    unexpected = [PREFIX + n for n in tensors if n not in expected]
    if unexpected:
        raise ValueError(f"MTP head: {where} has mtp.* tensors this model's {count}-layer head does not hold: "
                         f"{_names(unexpected)} (another MTP layer count or layout?)")
    bad = [f"{PREFIX}{n} {tuple(t.shape)} (the model needs {tuple(expected[n])})" for n, t in tensors.items()
           if t.shape != expected[n]]
    if bad:
        raise ValueError(f"MTP head: {where}: shapes that do not fit the model: {_names(bad, 4)}")
    weight = model.get_input_embeddings().weight
    state = {n: t.to(device=weight.device, dtype=weight.dtype) for n, t in tensors.items()}
    head.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*head.named_parameters(), *head.named_buffers()] if t.is_meta]
    if left:  # a buffer the checkpoint does not hold (none in the released classes)
        raise ValueError(f"MTP head: {type(head.layers[0]).__name__} holds tensors no checkpoint provides: "
                         f"{_names(left)}")
    return head.requires_grad_(False).eval()
