"""The attention core's constructor, shared by every attention op: each op states the parts it uses.

Every attention node builds one module class, :class:`specvit.nn.attention.Attention`, whose parts are
constructor arguments; an op's ``ctor`` is :func:`core_args` with the parts it turns on.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ATTENTION_MODULE", "core_args"]

ATTENTION_MODULE = "specvit.nn.attention:Attention"
"""The module every attention op builds."""

_CORE_PARTS: dict[str, Any] = {
    "memory_dim": None,
    "projection": "packed",
    "cosine": False,
    "talking_heads": False,
    "relative": None,
    "softcap": None,
    "causal": False,
    "window": None,
    "queries": None,
    "grid": None,
    "grid_window": None,
}


def core_args(**args: Any) -> dict[str, Any]:
    """Constructor arguments of the attention core (``specvit.nn.attention:Attention``) with every part
    stated, the ones not in ``args`` off: an ejected layer folds the parts its model never uses."""
    return {**_CORE_PARTS, **args}
