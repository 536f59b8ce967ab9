"""Tables whose weights' names depend on the spec they read (and the keys they name): the norm that feeds
the MLP of a block whose parallel residual a config switches (StableLM, Falcon), or the order of the heads
in a fused projection whose head layout a config switches (GPT-BigCode without multi-query, Falcon).

A :class:`~specvit.interop.table.Table` names its weights once, for every config; a :class:`Variant` adds
the names that follow from the spec made of one config, so the family stays one table and one
``model_type``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from specvit.interop.layout import Layout, heads_interleaved
from specvit.interop.table import Name, Renamed, Table

__all__ = ["Variant", "per_head_qkv", "variant"]


@dataclass(frozen=True)
class Variant(Table):
    """A :class:`Table` with names chosen by the spec.

    Args:
        chosen: (the spec, the state dict's keys) -> the names it adds or replaces (``{}`` where the table's
            own names hold).
    """

    chosen: Callable[[Any, Sequence[str]], Mapping[str, Name]] | None = None

    def layout(self, spec: Any, keys: Sequence[str]) -> Layout:
        """The table's layout with the names the spec chooses (see :meth:`Table.layout`).

        Args:
            spec: the spec whose weights are named.
            keys: the state dict's keys.
        """
        if self.chosen is None:
            return super().layout(spec, keys)
        names = {**self.names, **self.chosen(spec, keys)}
        return Table.layout(replace(self, names=names, chosen=None), spec, keys)


def variant(table: Table, chosen: Callable[[Any, Sequence[str]], Mapping[str, Name]]) -> Variant:
    """``table`` as a :class:`Variant`: a base for families whose names follow their spec.

    Args:
        table: the layout's table.
        chosen: (the spec, the state dict's keys) -> the names it adds or replaces.
    """
    values = {f.name: getattr(table, f.name) for f in fields(Table)}
    return Variant(**values, chosen=chosen)


def per_head_qkv(source: str, role: str = "decoder") -> Callable[[Any, Sequence[str]], Mapping[str, Name]]:
    """The fused projection ``source`` read per head ([q_h, k_h, v_h] for each head h) where the spec has as
    many key/value heads as heads, and as [q; k; v] (specvit's order) where it has fewer (multi-query).

    Args:
        source: the HF fused projection (``h.{i}.attn.c_attn``).
        role: the stack.
    """

    def chosen(spec: Any, keys: Sequence[str]) -> Mapping[str, Name]:
        block = spec.stacks[role].block
        if block.kv_heads is not None and block.kv_heads != block.heads:
            return {}
        return {f"{role}.blocks.{{i}}.attn.qkv": Renamed(source, heads_interleaved(block.heads))}

    return chosen
