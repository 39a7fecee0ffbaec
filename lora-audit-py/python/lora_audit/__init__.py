"""Vet a PEFT LoRA adapter for multi-LoRA serving before it ships.

The audit places every tensor of an adapter exactly (rank and alpha patterns,
rsLoRA, both transformers expert formats, trainable tokens) or refuses it with
a stable code naming the tensor or config field; the same Rust code as the
``lora-audit`` command, whose ``--json`` report :meth:`Report.to_dict` returns.

>>> import lora_audit
>>> report = lora_audit.check("out/adapter", "base/config.json", max_rank=16)
>>> report.servable, report.codes

``check`` returns the report, servable or not, and raises :class:`InputError`
for unreadable input; ``probe`` raises :class:`RefusedError` (with ``codes``,
``refusals`` and ``report``) for a refused adapter. Both read the ``LORA_*``
options from the environment as the command does; the arguments override them.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

from ._native import AuditError, InputError, RefusedError, Refusal, Report
from . import _native

__all__ = ["check", "probe", "Report", "Refusal", "AuditError", "InputError", "RefusedError"]

PathLike = Union[str, "os.PathLike[str]"]
#: A tensor as ``(dtype, shape)``: ``("BF16", [16, 4096])`` or ``(torch.bfloat16, (16, 4096))``.
TensorSpec = Tuple[Any, Sequence[int]]


def _model_args(model: Union[PathLike, Mapping[str, Any]]) -> dict:
    if isinstance(model, Mapping):
        return {"model_json": json.dumps(dict(model), default=_json_default)}
    if isinstance(model, (str, os.PathLike)):
        return {"model_path": os.fspath(model)}
    raise InputError(f"model must be a config.json path or a dict, not {type(model).__name__}")


def _tensor_list(tensors: Mapping[str, Any]) -> list:
    out = []
    for name, spec in tensors.items():
        if hasattr(spec, "dtype") and hasattr(spec, "shape"):
            dtype, shape = spec.dtype, spec.shape
        else:
            try:
                dtype, shape = spec
            except (TypeError, ValueError):
                raise InputError(f"tensor {name!r}: give (dtype, shape) or a tensor, not {spec!r}") from None
        try:
            dims = [int(d) for d in shape]
        except (TypeError, ValueError):
            raise InputError(f"tensor {name!r}: shape {shape!r} is not a list of integers") from None
        if any(d < 0 or d >= 2**63 for d in dims):
            raise InputError(f"tensor {name!r}: shape {dims} has a negative or impossibly large dimension")
        out.append((str(name), str(dtype), dims))
    return out


def check(
    adapter: Union[PathLike, Mapping[str, Any]],
    model: Union[PathLike, Mapping[str, Any]],
    *,
    max_rank: Optional[int] = None,
    expert_rank: Optional[int] = None,
    allow_partial: bool = False,
    experts: bool = False,
    dora: bool = False,
    embedding_lora: bool = False,
    lm_head_lora: bool = False,
    tensors: Optional[Mapping[str, Any]] = None,
    name: Optional[str] = None,
) -> Report:
    """Audit an adapter against a base model.

    ``adapter``: a directory (``adapter_config.json`` + ``adapter_model.safetensors``),
    or a PEFT ``LoraConfig`` as a dict (``config.to_dict()``) with ``tensors``: every
    adapter tensor by its saved name, as ``(dtype, shape)`` or a tensor (e.g.
    ``get_peft_model_state_dict(model)``). Given as a dict, the values are not read,
    so non-finite weights are found only by the directory form.
    ``model``: the base model's ``config.json`` path, or that config as a dict.
    """
    args = _model_args(model)
    if isinstance(adapter, Mapping):
        if tensors is None:
            raise InputError("an adapter config needs its tensors: tensors={name: (dtype, shape)}")
        config = json.dumps(dict(adapter), default=_json_default)
        return _native.check(config_json=config, tensors=_tensor_list(tensors), name=name,
                             max_rank=max_rank, expert_rank=expert_rank,
                             allow_partial=allow_partial, experts=experts, dora=dora, embedding_lora=embedding_lora, lm_head_lora=lm_head_lora, **args)
    if not isinstance(adapter, (str, os.PathLike)):
        raise InputError(f"adapter must be a directory or a config dict, not {type(adapter).__name__}")
    if tensors is not None:
        raise InputError("tensors go with an adapter config dict; a directory has its own")
    return _native.check(adapter_dir=os.fspath(adapter), max_rank=max_rank, expert_rank=expert_rank,
                         allow_partial=allow_partial, experts=experts, dora=dora, embedding_lora=embedding_lora, lm_head_lora=lm_head_lora, **args)


def probe(
    adapter: PathLike,
    model: Union[PathLike, Mapping[str, Any]],
    probes: PathLike,
    out: PathLike,
    *,
    base: Optional[PathLike] = None,
    max_rank: Optional[int] = None,
    expert_rank: Optional[int] = None,
    allow_partial: bool = False,
    experts: bool = False,
    dora: bool = False,
    embedding_lora: bool = False,
    lm_head_lora: bool = False,
) -> dict:
    """The adapter's served deltas for the probe inputs in ``probes``, written to
    ``out`` (the command's ``probe``). Returns ``{"out", "written", "unserved"}``;
    raises :class:`RefusedError` for a refused adapter."""
    written, unserved = _native.probe(
        adapter_dir=os.fspath(adapter), probes=os.fspath(probes), out=os.fspath(out),
        base=None if base is None else os.fspath(base), max_rank=max_rank, expert_rank=expert_rank,
        allow_partial=allow_partial, experts=experts, dora=dora, embedding_lora=embedding_lora, lm_head_lora=lm_head_lora, **_model_args(model))
    return {"out": os.fspath(out), "written": written, "unserved": unserved}


def _json_default(value: Any) -> Any:
    # LoraConfig.to_dict() holds sets (target_modules) and enums (task_type);
    # a model config may hold a torch dtype. Anything else by its text: the
    # audit checks every field it reads.
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if hasattr(value, "value"):
        return value.value
    return str(value)
