"""The checks API entry points run on their arguments: each returns the value as the type it must be, or raises
a TypeError (a value of the wrong type) or ValueError (the right type, out of range) that names the argument
and says what to pass. One function per kind of argument, so that ``build_model``, ``build_graph``,
``generate``, ``save_pretrained`` and ``convert_state_dict`` refuse alike.

Imports nothing heavy: torch is imported by the functions that need it (their callers have it loaded).
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["INT64_MAX", "compute_dtype", "device", "flag", "integer", "path", "tensors"]

INT64_MAX = (1 << 63) - 1
"""The largest integer a torch.long tensor holds: ids and counts above it cannot reach a tensor."""


def integer(
    value: object, name: str, *, low: int | None = None, high: int = INT64_MAX, hint: str = ""
) -> int:
    """``value`` as an int in ``low..high`` (NumPy integers and 0-d integer tensors too).

    Args:
        value: the argument.
        name: its name, for the message.
        low: the least it may be (None: no bound below).
        high: the most it may be (default: what an int64 holds).
        hint: what to do instead, appended to a ValueError.

    Raises:
        TypeError: a bool, float, string or anything else that is not an integer.
        ValueError: an integer out of range.
    """
    torch = sys.modules.get("torch")  # a tensor can only come from a process that imported torch
    if (
        torch is not None
        and isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not value.is_floating_point()
    ):
        value = value.item()
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        shown = repr(value) if isinstance(value, int | float | str) and len(repr(value)) < 40 else ""
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {shown}".rstrip()) from None
    if (low is not None and n < low) or n > high:
        bound = f">= {low}" if low is not None and n < low else f"<= {high}"
        shown = str(n) if len(str(n)) <= 30 else f"an integer of {len(str(abs(n)))} digits"
        raise ValueError(f"{name} must be {bound}, got {shown}" + (f" ({hint})" if hint else ""))
    return n


def flag(value: object, name: str) -> bool:
    """``value`` as a bool: True or False only (a string ``"no"`` is truthy).

    Args:
        value: the argument.
        name: its name, for the message.

    Raises:
        TypeError: for anything but a bool (NumPy's too).
    """
    if type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}"[:200])


def compute_dtype(value: object, name: str = "dtype") -> torch.dtype | None:
    """``value`` as a floating-point torch dtype a model computes in, or None (torch's default).

    Args:
        value: a ``torch.dtype``, or its name as a string (``"float16"``, ``"torch.bfloat16"``).
        name: the argument's name, for the message.

    Raises:
        TypeError: not a dtype or the name of one.
        ValueError: a dtype weights cannot compute in: integers, booleans, complex numbers, float8.
    """
    import torch

    if value is None:
        return None
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(found, torch.dtype):
            raise TypeError(f"{name} must be a torch.dtype such as torch.float32, got the string {value!r}")
        value = found
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype such as torch.float32, got {type(value).__name__}")
    if not value.is_floating_point or value.itemsize < 2:
        raise ValueError(
            f"{name} {value} is not a dtype weights compute in (training and inference take floating point, "
            "of 16 bits or more); pass torch.float32, torch.bfloat16, torch.float16 or torch.float64"
        )
    return value


def device(value: object, name: str = "device") -> torch.device:
    """``value`` as a torch.device (None: the CPU).

    Args:
        value: a ``torch.device``, a string such as ``"cpu"`` or ``"cuda:0"``, an int (a CUDA index) or None.
        name: the argument's name, for the message.

    Raises:
        TypeError: not a device, a string or an int.
        ValueError: a string torch does not read as a device.
    """
    import torch

    if value is None:
        return torch.device("cpu")
    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TypeError(
            f"{name} must be a torch.device or a string such as 'cpu', got {type(value).__name__}"
        )
    try:
        return torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{name} {value!r} is not a device torch knows (e.g. 'cpu', 'cuda:0', 'meta')"
        ) from None


def path(value: object, name: str) -> str | os.PathLike[str]:
    """``value`` if it is a path (a string or os.PathLike), else a TypeError naming the argument.

    Args:
        value: the argument.
        name: its name, for the message.
    """
    if isinstance(value, str | os.PathLike) and not isinstance(os.fspath(value), bytes):
        return value
    raise TypeError(f"{name} must be a path (a str or pathlib.Path), got {type(value).__name__}")


def tensors(value: object, name: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping of string keys to tensors (a state dict), else a TypeError naming the
    first entry that is not.

    Args:
        value: the argument.
        name: its name, for the message.
    """
    import torch

    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a mapping of names to tensors (a state dict), got {type(value).__name__}"
        )
    for key, tensor in value.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{name} has a key of type {type(key).__name__} ({key!r:.40}); its keys are names"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}[{key!r:.80}] must be a tensor, got {type(tensor).__name__}")
    return value
