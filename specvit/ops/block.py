"""Blocks: what a sublayer of a block's ``layers:`` list sees while it lowers, and the sublayer registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from specvit.ops.base import Params, StackCtx
from specvit.ops.norm import NormParams

__all__ = ["BLOCK_INPUTS", "SUBLAYERS", "BlockCtx", "Sublayer", "block_input", "sublayer"]


class BlockCtx:
    """What a sublayer's ``lower`` may use while one block is lowered.

    Args:
        stack: the stack being lowered.
        spec: the block's spec.
        path: the block's path (``encoder.blocks.3``).
        dim: its width.
        heads: its query heads.
        kv_heads: its key/value heads.
        head_dim: its width per head.
        layers: a counter of the attention layers lowered so far in the model (their KV-cache indexes).
        index: its index in its stage (Swin shifts the windows of every second block).
        grid: the token grid, or None.
        stage: the index of its stage (per-stage settings).
    """

    def __init__(
        self,
        stack: StackCtx,
        spec: Any,
        path: str,
        *,
        dim: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        layers: list[int],
        index: int = 0,
        grid: tuple[int, int] | None = None,
        stage: int = 0,
    ):
        self.stack, self.spec, self.path = stack, spec, path
        self.dim, self.heads, self.kv_heads, self.head_dim = dim, heads, kv_heads, head_dim
        self.index, self.grid, self.stage = index, grid, stage
        self._layers = layers

    @property
    def side(self) -> dict[str, str]:
        return self.stack.side

    def next_layer(self) -> int:
        """A new KV-cache layer index."""
        self._layers[0] += 1
        return self._layers[0] - 1

    def add(self, name: str, kind: str, p: Params, srcs: Mapping[str, str], *, source: str) -> str:
        """Add node ``name`` of this block."""
        return self.stack.add(f"{self.path}.{name}", kind, p, srcs, source=source, block=self.path)

    def enter(self, x: str) -> str:
        """The block's input tokens after what the registered :data:`BLOCK_INPUTS` add to them (a block's own
        position table), the node its first step reads.

        Args:
            x: the tokens that reach the block.
        """
        for step in BLOCK_INPUTS:
            x = step(self, x)
        return x

    @staticmethod
    def beside(name: str, own: str, part: str) -> str:
        """The name of a node a sublayer named ``name`` adds beside itself: ``own`` in it replaced by ``part``
        (``mlp`` -> ``router``, ``attn2`` -> ``rel_bias2``), or ``{name}_{part}`` when a block graph named the
        sublayer otherwise, so the two never share a name."""
        return name.replace(own, part) if own in name else f"{name}_{part}"

    def norm(self, name: str, x: str, source: str) -> str:
        """Add a norm of the block's kind over ``x``'s last dim."""
        dim = self.stack.shape(x)[-1]
        assert isinstance(dim, int)
        n = self.spec.norm
        return self.add(name, n.kind, NormParams.of(n, dim), {"x": x}, source=source)


class Sublayer:
    """One entry of a block's ``layers:`` list: lowers to the nodes of one residual branch.

    Attributes:
        kind: the name written in ``layers:``.
        name: the module name in the block (``attn``); numbered when a block has two (``attn1``).
    """

    kind: ClassVar[str]
    name: ClassVar[str]

    def lower(self, b: BlockCtx, x: str, name: str, source: str) -> str:
        """Add the branch's nodes reading ``x``; return the branch's output node."""
        raise NotImplementedError


SUBLAYERS: dict[str, Sublayer] = {}

S = TypeVar("S", bound=type[Sublayer])


def sublayer(cls: S) -> S:
    """Register a :class:`Sublayer` under its ``kind``."""
    SUBLAYERS[cls.kind] = cls()
    return cls


BLOCK_INPUTS: list[Callable[[BlockCtx, str], str]] = []
"""Functions run on a block's input before its first step, in order (``block.absolute_position``: a learned table added
to the tokens); each takes the block and its input node and returns the new input node (the same when the
block asks for nothing)."""


def block_input(fn: Callable[[BlockCtx, str], str]) -> Callable[[BlockCtx, str], str]:
    """Register ``fn`` in :data:`BLOCK_INPUTS`."""
    BLOCK_INPUTS.append(fn)
    return fn
