"""Checkpoints: a directory with ``spec.yaml`` and ``model.safetensors``. Never pickle.

:func:`specvit.load_pretrained` rebuilds the model from the spec on the meta device, checks every key and
shape of the weight file against it (:func:`read_weights`) before anything is allocated, then assigns the
loaded tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specvit.io import atomic_write

__all__ = ["SPEC_FILE", "WEIGHTS_FILE", "CheckpointError", "read_weights", "save_pretrained"]

SPEC_FILE = "spec.yaml"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or does not match its spec."""


def save_pretrained(
    model: Any,
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


def read_weights(
    directory: str | os.PathLike[str], expected: Mapping[str, tuple[int, ...]], device: str
) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint directory, checked key by key and shape by shape against ``expected``.

    Args:
        directory: the checkpoint directory.
        expected: the model's state_dict keys and shapes.
        device: where to load the tensors.

    Raises:
        CheckpointError: when the weight file is missing, truncated, corrupted, or its keys or shapes
            do not match (every mismatch is named).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing")
    try:
        state = load_file(weights, device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights} is truncated or corrupted ({exc})") from None
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
    return state
