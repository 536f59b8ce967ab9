"""The machinery of weight conversion: a table from each target key to its source keys and a transform.

Shared by :mod:`specvit.convert` and the per-family layouts of :mod:`specvit.interop`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specvit.spec.schema import Spec, StackSpec

__all__ = [
    "BlockSlice",
    "Entry",
    "Layout",
    "Misfit",
    "RowShare",
    "Transform",
    "Undoable",
    "batched",
    "cat",
    "check_blocks",
    "conv1d",
    "flat",
    "heads_interleaved",
    "one",
    "patches",
    "prefix",
    "rows",
    "same",
    "unbatched",
]

Transform = Callable[[Sequence[Tensor]], Tensor]
Entry = tuple[tuple[str, ...], Transform]  # source key templates, and how to make the target from them

_BLOCK = re.compile(r"\.blocks\.(\d+)\.")


class Misfit(ValueError):
    """A layout whose names mean other modules in this spec (a norm after the attention, not before): the
    converter tries the next layout of the keys, and says this only when none places them."""


# -- transforms ---------------------------------------------------------------------------------------


def same(ts: Sequence[Tensor]) -> Tensor:
    return ts[0]


def cat(ts: Sequence[Tensor]) -> Tensor:
    return torch.cat(tuple(ts), dim=0)  # separate q, k, v (or gate, value) -> one packed projection


def conv1d(ts: Sequence[Tensor]) -> Tensor:
    """GPT-2's ``Conv1D`` stores weights as (in, out); ``nn.Linear`` wants (out, in). Biases pass through."""
    return ts[0].t().contiguous() if ts[0].ndim == 2 else ts[0]


def batched(ts: Sequence[Tensor]) -> Tensor:
    return ts[0].unsqueeze(0)  # (N, D) position table -> (1, N, D)


def flat(ts: Sequence[Tensor]) -> Tensor:
    return ts[0].reshape(-1)  # a (1, N) buffer (BART's final_logits_bias) -> a bias (N,)


def patches(ts: Sequence[Tensor]) -> Tensor:
    """A Conv2d patch weight (D, C, ph, pw) as the equivalent Linear weight (D, C*ph*pw); biases pass."""
    return ts[0].flatten(1) if ts[0].ndim == 4 else ts[0]


def unbatched(ts: Sequence[Tensor]) -> Tensor:
    """A learned (1, N, D) array (timm's ``attn_pool.latent``, SigLIP's ``probe``) as specvit's (N, D)."""
    return ts[0].squeeze(0)


@dataclass(frozen=True)
class Undoable:
    """A transform of one source tensor that ``to_hf`` can run backwards (a reordering of rows).

    Args:
        forward: the source tensor -> specvit's.
        backward: specvit's tensor -> the source's.
    """

    forward: Callable[[Tensor], Tensor]
    backward: Callable[[Tensor], Tensor]

    def __call__(self, ts: Sequence[Tensor]) -> Tensor:
        return self.forward(ts[0])

    def undo(self, t: Tensor) -> Tensor:
        """specvit's tensor as the source's."""
        return self.backward(t).contiguous()


@dataclass(frozen=True)
class RowShare:
    """Part ``part`` of a source tensor whose rows split in the proportions ``shares`` (the q third of
    ``nn.MultiheadAttention``'s ``in_proj``, ``RowShare(0, (1, 2))``, and its k and v, ``RowShare(1, (1, 2))``);
    ``to_hf`` joins the parts back.

    Args:
        part: which part.
        shares: the parts' sizes, relative.
    """

    part: int
    shares: tuple[int, ...]

    def __call__(self, ts: Sequence[Tensor]) -> Tensor:
        unit = ts[0].shape[0] // sum(self.shares)
        start = unit * sum(self.shares[: self.part])
        return ts[0][start : start + unit * self.shares[self.part]]


@dataclass(frozen=True)
class BlockSlice:
    """Block i's slice of a tensor that stacks every block's along ``dim`` (timm's RoPE-Mixed frequencies,
    (2, depth, H, hd/2)): :meth:`Layout.sources` binds ``index`` to the target's block.

    Args:
        dim: the blocks' dimension.
        index: the block, bound per target.
    """

    dim: int
    index: int | None = None

    def __call__(self, ts: Sequence[Tensor]) -> Tensor:
        assert self.index is not None, "a BlockSlice is bound to its block by Layout.sources"
        return ts[0].select(self.dim, self.index).contiguous()


def rows(start: int, stop: int | None) -> Transform:
    """Rows ``start:stop`` of a packed projection, e.g. ``q`` or ``kv`` out of an ``in_proj``."""

    def take(ts: Sequence[Tensor]) -> Tensor:
        return ts[0][start:stop]

    return take


def one(source: str, transform: Transform = same) -> Entry:
    return (source,), transform


def heads_interleaved(heads: int, parts: int = 3) -> Transform:
    """A fused projection stored per head ([q_h, k_h, v_h] for each head h: GPT-NeoX, BLOOM) as specvit's
    [q; k; v] (all heads' q, then k, then v)."""

    def take(t: Tensor) -> Tensor:
        grouped = t.reshape(heads, parts, t.shape[0] // (heads * parts), *t.shape[1:])  # (H, 3, hd, ...)
        return grouped.transpose(0, 1).reshape(t.shape).contiguous()  # (3 * H * hd, ...)

    def back(t: Tensor) -> Tensor:
        grouped = t.reshape(parts, heads, t.shape[0] // (heads * parts), *t.shape[1:])  # (3, H, hd, ...)
        return grouped.transpose(0, 1).reshape(t.shape)  # (H * 3 * hd, ...)

    return Undoable(take, back)


# -- layouts ------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """How one source format names the parameters of a spec's model.

    Args:
        name: the source format, for messages.
        table: target key template -> source key templates and transform. ``{i}`` stands for a block
            index and ``{p}`` for a parameter name; a template without ``{p}`` names one parameter.
        ignore: regular expressions of source keys that are buffers, not parameters.
        tied: source key -> the source key it must equal; dropped (a tied head's copy of the embedding).
        zeros: source keys of buffers the spec has no place for, accepted only when all zero (BART's
            ``final_logits_bias`` for a head without a bias), with the fix if they are not.
        fixed: source keys of frozen tables the spec computes instead of storing (MAE's sin-cos
            positions), accepted only when they equal the spec's values (to 1e-5): the table, or a function
            of the stored table's shape giving it (Marian's sinusoids, as many rows as the checkpoint's).
    """

    name: str
    table: dict[str, Entry]
    ignore: tuple[str, ...] = ()
    tied: dict[str, str] = field(default_factory=dict)
    zeros: dict[str, str] = field(default_factory=dict)
    fixed: Mapping[str, Tensor | Callable[[tuple[int, ...]], Tensor]] = field(default_factory=dict)

    def sources(self, target: str) -> Entry | None:
        """The source keys of one target key and their transform, or None if the format has no such part."""
        match = _BLOCK.search(target)
        index = match.group(1) if match else ""
        generic = _BLOCK.sub(".blocks.{i}.", target, count=1)
        module, _, param = generic.rpartition(".")
        entry = self.table.get(generic)
        if entry is None:
            entry = self.table.get(module + ".{p}")
        if entry is None:
            return None
        templates, transform = entry
        if isinstance(transform, BlockSlice):
            transform = BlockSlice(transform.dim, int(index))
        return tuple(t.format(i=index, p=param) for t in templates), transform

    def ignored(self, key: str) -> bool:
        return any(re.fullmatch(pattern, key) for pattern in self.ignore)


def check_blocks(
    spec: Spec, role: str, source: str, layers: Iterable[tuple[str, ...]], placement: str | None = None
) -> StackSpec:
    """The stack ``role`` of ``spec``, after checking that its blocks have a layout ``source`` can hold.

    Args:
        spec: the target spec.
        role: ``encoder`` or ``decoder``.
        source: the source format, for messages.
        layers: the sublayer orders the format's blocks can have.
        placement: the norm placement of the format's blocks, or None when the weights fit either.
    """
    stack = spec.stacks[role]
    allowed = list(layers)
    if tuple(stack.block.layers) not in allowed:
        shown = " or ".join(str(list(a)) for a in allowed)
        raise ValueError(
            f"{source} blocks have the sublayers {shown}, but spec {spec.name!r} has "
            f"{role}.block.layers {list(stack.block.layers)}"
        )
    if placement is not None and stack.block.norm.placement != placement:
        raise ValueError(
            f"{source} blocks are {placement}-norm, but spec {spec.name!r} has "
            f"{role}.block.norm.placement {stack.block.norm.placement}"
        )
    return stack


def prefix(keys: Iterable[str], prefix: str) -> str:
    """``prefix`` if any key starts with it (a task model's backbone), else the empty string."""
    return prefix if any(k.startswith(prefix) for k in keys) else ""
