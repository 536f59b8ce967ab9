"""What a stack's spec resolves to, computed once (:class:`StackFacts`), and the typed view of the spec
that fragments read (:class:`StackView`, :class:`SpecView`).

A stack's head width, stage widths, prefix count, token grid and longest sequence are derived in one
place, :meth:`specvit.spec.schema.StackSpec.facts`, when the spec is validated; the lowering, the rules,
the input checks, export, ``generate`` and the importers read these numbers (the compiled side through
``ArchGraph.facts``), never a formula of their own.

The views are Protocols, so :mod:`specvit.ops` types what it reads of :mod:`specvit.spec` without
importing it (the spec language imports the ops to assemble its unions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from specvit.errors import Location

__all__ = [
    "SpecView",
    "StackFacts",
    "StackView",
    "StageFacts",
    "Undetermined",
    "resolve",
    "unless_undetermined",
]

T = TypeVar("T")


class Undetermined(Exception):
    """A derived value the spec leaves undetermined, read by a rule: heads that do not divide the width
    leave no head dim. The rule that finds the cause reports it; a rule reading the value is skipped, so
    that one mistake gives one message (``rope2d needs a head dim divisible by 4, got 38`` is not said).

    Args:
        name: the value (``head_dim``).
    """


def unless_undetermined(rule: Callable[[], list[T]]) -> list[T]:
    """The problems ``rule`` finds, or none when it reads a value the spec leaves :class:`Undetermined`.

    Args:
        rule: a rule, called with no arguments.
    """
    try:
        return rule()
    except Undetermined:
        return []


@dataclass(frozen=True)
class StageFacts:
    """One stage of a stack (a plain stack is one stage).

    Args:
        width: token width of its blocks.
        depth: its number of blocks.
        heads: query heads.
        kv_heads: key/value heads (GQA/MQA: fewer than ``heads``).
        head_dim: width per head.
    """

    width: int
    depth: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StackFacts:
    """The resolved numbers of one stack.

    Args:
        stages: each stage's width, depth and head layout.
        embedding_width: width of the token embeddings and what is added to them (``embed_width`` or the
            width).
        num_prefix: class, distillation and register tokens.
        prefix_at: the index of the first block that sees the prefix tokens.
        max_len: the longest sequence the stack takes: a learned table's rows less the prefix tokens it
            covers, else :data:`specvit.ops.base.MAX_LEN`.
        grid: the (rows, cols) token grid of an image or feature-map input, or None.
        out_grid: the grid of the last stage (the first's in a plain stack), or None.
        num_tokens: tokens the first blocks see when the input fixes them (images, feature maps, queries).
        causal: some self-attention is causal: the stack decodes token by token with a KV cache.
    """

    stages: tuple[StageFacts, ...]
    embedding_width: int
    num_prefix: int
    prefix_at: int
    max_len: int
    grid: tuple[int, int] | None
    out_grid: tuple[int, int] | None
    num_tokens: int | None
    causal: bool

    @property
    def width(self) -> int:
        """Width of the first stage (every block's, in a plain stack)."""
        return self.stages[0].width

    @property
    def out_width(self) -> int:
        """Width of the stack's output (the last stage's)."""
        return self.stages[-1].width

    @property
    def heads(self) -> int:
        """Query heads of the first stage."""
        return self.stages[0].heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the first stage."""
        return self.stages[0].kv_heads

    @property
    def head_dim(self) -> int:
        """Width per head of the first stage."""
        return self.stages[0].head_dim

    @property
    def total_depth(self) -> int:
        return sum(stage.depth for stage in self.stages)


class StackView(Protocol):
    """What fragments read of a stack's spec (:class:`specvit.spec.schema.StackSpec`)."""

    # The fragments' own classes live in the op modules that read these views, so they are Any here.
    @property
    def input(self) -> Any: ...  # specvit.ops.inputs.InputFragment
    @property
    def width(self) -> int: ...
    @property
    def block(self) -> Any: ...  # specvit.spec.block.BlockSpec
    @property
    def prefix(self) -> Any: ...  # specvit.spec.schema.PrefixSpec
    @property
    def position(self) -> Any: ...  # as written: one kind or a list
    @property
    def dropout(self) -> Any: ...  # specvit.spec.schema.DropoutSpec
    @property
    def masking(self) -> Any: ...  # specvit.ops.masking.MaskingSpec | None
    @property
    def merge_norm(self) -> str: ...
    @property
    def downsample(self) -> list[Any] | None: ...  # the map layers between stages, or patch merging

    def stage_ops(self, i: int) -> list[Any]: ...
    @property
    def final_norm(self) -> bool: ...
    @property
    def embed_norm(self) -> bool: ...
    @property
    def facts(self) -> StackFacts: ...
    @property
    def positions(self) -> list[Any]: ...  # specvit.ops.position.PositionFragment
    @property
    def layer_blocks(self) -> list[Any]: ...  # specvit.spec.block.BlockSpec of each layer
    @property
    def hierarchical(self) -> bool: ...
    # the derived numbers, for the rules, which also run on specs that do not resolve
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...  # raises Undetermined when the heads do not divide the width
    @property
    def stage_heads(self) -> list[int]: ...
    @property
    def stage_depths(self) -> list[int]: ...
    @property
    def stage_widths(self) -> list[int]: ...
    @property
    def total_depth(self) -> int: ...
    @property
    def out_width(self) -> int: ...
    @property
    def embedding_width(self) -> int: ...
    @property
    def num_prefix(self) -> int: ...
    @property
    def prefix_at(self) -> int: ...
    @property
    def causal(self) -> bool: ...
    @property
    def grid(self) -> tuple[int, int] | None: ...
    @property
    def out_grid(self) -> tuple[int, int] | None: ...
    @property
    def max_len(self) -> int: ...
    @property
    def num_tokens(self) -> int | None: ...

    def layer(self, i: int) -> Any: ...


class SpecView(Protocol):
    """What fragments read of the whole spec (:class:`specvit.spec.schema.Spec`)."""

    @property
    def model(self) -> str: ...
    @property
    def init(self) -> str | None: ...
    @property
    def head(self) -> Any: ...  # specvit.ops.heads.HeadFragment
    @property
    def output_stack(self) -> str: ...
    @property
    def shared_embeddings(self) -> bool: ...
    @property
    def stacks(self) -> Mapping[str, StackView]: ...
    @property
    def encoder(self) -> StackView | None: ...
    @property
    def decoder(self) -> StackView | None: ...

    def locate(self, path: str) -> Location | None: ...


def resolve(stack: StackView) -> StackFacts:
    """A stack's facts, from the one property that derives each (:class:`specvit.spec.schema.StackSpec`).

    Args:
        stack: a validated stack whose rules hold.
    """
    hierarchical = stack.hierarchical  # each stage of a hierarchical stack splits its width into heads
    return StackFacts(
        stages=tuple(
            StageFacts(
                width=w,
                depth=d,
                heads=h,
                kv_heads=h if hierarchical else stack.kv_heads,
                head_dim=w // h if hierarchical else stack.head_dim,
            )
            for w, d, h in zip(stack.stage_widths, stack.stage_depths, stack.stage_heads, strict=True)
        ),
        embedding_width=stack.embedding_width,
        num_prefix=stack.num_prefix,
        prefix_at=stack.prefix_at,
        max_len=stack.max_len,
        grid=stack.grid,
        out_grid=stack.out_grid,
        num_tokens=stack.num_tokens,
        causal=stack.causal,
    )
