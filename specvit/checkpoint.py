"""Checkpoints: a directory with ``spec.yaml`` and ``model.safetensors``. Never pickle.

Loading rebuilds the model from the spec on the meta device, checks every key and shape of the
weight file against it before anything is allocated, then assigns the loaded tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from specvit.io import atomic_write
from specvit.model import SpecModel

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained"]

SPEC_FILE = "spec.yaml"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or does not match its spec."""


def save_pretrained(
    model: SpecModel,
    directory: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write the model's canonical spec and weights into ``directory``.

    Each file is written whole or not at all (temporary file, then rename).

    Args:
        model: a compiled model.
        directory: created if missing.
        overwrite: allow writing into a directory that already has files.
        state_dict: the weights to write; default ``model.state_dict()``.

    Raises:
        CheckpointError: when ``directory`` is a file, or is not empty and ``overwrite`` is False.
    """
    from safetensors.torch import save

    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{path} is not empty; pass overwrite=True to replace its checkpoint")
    path.mkdir(parents=True, exist_ok=True)
    weights = model.state_dict() if state_dict is None else state_dict
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    atomic_write(
        path / WEIGHTS_FILE, save(tensors, metadata={"format": "pt", "specvit_spec": model.spec.name})
    )
    atomic_write(path / SPEC_FILE, model.spec.to_yaml())
    return path


def load_pretrained(
    directory: str | os.PathLike[str],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> SpecModel:
    """Rebuild a model saved by :func:`save_pretrained`, in eval mode (as HF's ``from_pretrained``).

    Args:
        directory: the checkpoint directory.
        device: where the weights go (default CPU).
        dtype: cast the weights to this dtype (default: as stored).

    Raises:
        SpecError: when ``spec.yaml`` is invalid.
        CheckpointError: when the weight file is missing, truncated, corrupted, or its keys or shapes
            do not match the spec (every mismatch is named).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specvit.compile import build_model
    from specvit.spec import load_spec

    path = Path(directory)
    spec = load_spec(path / SPEC_FILE)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing")
    try:
        state = load_file(weights, device=str(torch.device(device or "cpu")))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights} is truncated or corrupted ({exc})") from None
    model = build_model(spec, device="meta", dtype=dtype)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    problems = [f"missing {k} {list(s)}" for k, s in expected.items() if k not in got]
    problems += [f"unexpected {k} {list(s)}" for k, s in got.items() if k not in expected]
    problems += [
        f"{k}: checkpoint has {list(got[k])}, the spec needs {list(s)}"
        for k, s in expected.items()
        if k in got and got[k] != s
    ]
    if problems:
        shown = "\n  ".join(problems[:20]) + (
            f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise CheckpointError(f"the weights in {weights} do not match {path / SPEC_FILE}:\n  {shown}")
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
