"""The tensor-parallel styles :func:`specvit.tensor_parallel.plan` puts in a plan: ``torch``'s column- and
row-wise styles with a line saying what they split, and the styles of what torch has none for: a packed
projection split per part (q|k|v, k|v, gate|value), an attention layer's local head counts, a mixture of
experts split by expert, and an LM head tied to a vocabulary-parallel embedding.

Each style has a ``note``: what :func:`specvit.tensor_parallel.describe` prints for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from specvit.nn.attention import Attention
from specvit.nn.layers import TiedLinear
from specvit.nn.moe import MoeMlp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Colwise",
    "ExpertSplit",
    "HeadSplit",
    "PackedColwise",
    "Rowwise",
    "TiedHead",
    "first_rows",
    "held_order",
    "packed_order",
    "packed_rows",
    "rank_major",
]


class Colwise(ColwiseParallel):
    """``ColwiseParallel`` with a line saying what it splits (``note``).

    Args:
        note: the description :func:`describe` prints.
        gather: gather the outputs on every rank (an LM head's logits) instead of keeping them split.
    """

    def __init__(self, note: str, gather: bool = False) -> None:
        super().__init__(output_layouts=Replicate() if gather else None)
        self.note = note


class Rowwise(RowwiseParallel):
    """``RowwiseParallel`` with a ``note``; ``embedding``: a vocabulary-parallel embedding (ids replicated).

    Args:
        note: the description :func:`describe` prints.
        embedding: the module is an embedding table.
    """

    def __init__(self, note: str, embedding: bool = False) -> None:
        super().__init__(input_layouts=Replicate() if embedding else None)
        self.note = note


def rank_major(parts: tuple[int, ...], ranks: int, heads: tuple[int, ...] | None = None) -> Tensor:
    """The rows of a packed projection (``parts`` rows each, e.g. q|k|v) in rank-major order: rank r's block
    holds the r-th 1/ranks of every part, so a contiguous split gives each rank whole heads of each part. A
    part of fewer heads than ranks (GQA's key/value heads over more ranks) gives each rank the one head its
    query heads read: its rows appear once per rank sharing that head.

    Args:
        parts: the rows of each part.
        ranks: the number of ranks.
        heads: the heads of each part (default: ``ranks`` each); a count the ranks divide, or that divides them.
    """
    starts = [sum(parts[:i]) for i in range(len(parts))]
    pieces = []
    for r in range(ranks):
        for start, rows, g in zip(starts, parts, heads or (ranks,) * len(parts), strict=True):
            per, first = rows // g, r * g // ranks  # rows of a head; the first head rank r holds
            pieces.append(torch.arange(start + first * per, start + (first + max(g // ranks, 1)) * per))
    return torch.cat(pieces)


def first_rows(order: Tensor) -> Tensor:
    """Where each row of one process's packed order first stands in ``order`` (rank-major, maybe with rows
    held by several ranks): the index that takes a rank-major tensor back to the packed order."""
    back = torch.empty(int(order.max()) + 1, dtype=torch.long)
    back[order.flip(0)] = torch.arange(len(order) - 1, -1, -1)  # the last write of a row is its first place
    return back


def packed_order(value: Tensor, order: Tensor, back: bool) -> Tensor:
    """A whole tensor of a packed projection's parameter (its weight or bias, or an optimizer state of one:
    AdamW's moments) taken from the rank-major ``order`` its ranks hold it in to one process's packed order
    (``back``: a row several ranks hold, a copied key/value head's, kept once), or from the packed order to
    the rank-major one. A tensor with another number of rows (a scalar step) comes back as it is.

    Args:
        value: the whole tensor, its rows along dim 0.
        order: the parameter's rank-major row order (:func:`rank_major`).
        back: rank-major -> packed (True), or packed -> rank-major.
    """
    first = first_rows(order)
    index, rows_in = (first, len(order)) if back else (order, len(first))
    if not value.dim() or value.shape[0] != rows_in:
        return value
    return value[index.to(value.device)]


def packed_rows(module: nn.Module) -> dict[str, Tensor]:
    """Parameter name -> the rank-major row order it is held in, for each tensor-parallel packed projection in
    ``module`` (a model, or a pipeline stage: names as in the model); the names :func:`packed_order` needs.

    Args:
        module: the split model, or a part of it.
    """
    return {
        f"{path}.{key}" if path else key: sub.rank_major
        for path, sub in module.named_modules()
        if isinstance(getattr(sub, "rank_major", None), Tensor)
        for key, _ in sub.named_parameters(recurse=False)
    }


_HELD: ContextVar[bool] = ContextVar("specvit_held_order", default=False)


@contextmanager
def held_order() -> Iterator[None]:
    """Within it, ``state_dict()`` and ``load_state_dict()`` of a packed projection take its parameters as its
    ranks hold them (rank-major, a copied key/value head once per rank) instead of translating them from and
    to one process's packed order: for code that gathers or scatters whole tensors through
    ``torch.distributed.checkpoint`` and translates them itself with :func:`packed_order`, the weights as the
    optimizer states (checkpoints: :func:`specvit.parallel.full_state_dict`,
    :func:`specvit.parallel.load_full_state_dict`, ``Pipeline.full_state``)."""
    token = _HELD.set(True)
    try:
        yield
    finally:
        _HELD.reset(token)


class PackedColwise(ColwiseParallel):
    """Column-wise split of a Linear packing ``parts`` (q|k|v, k|v, gate|value), each part split.

    The parameters are stored rank-major (see :func:`rank_major`); ``state_dict`` gives them back in the
    packed order of one process and ``load_state_dict`` takes that order (both gather the parameter).

    A part of fewer heads than ranks (key/value heads) is held by every rank whose query heads read it (see
    :func:`rank_major`); the copies' gradients, each from its rank's query heads, are summed over the ranks.

    Args:
        parts: the rows of each part.
        note: the description :func:`describe` prints.
        heads: the heads of each part (default: split evenly, ``ranks`` pieces each).
    """

    def __init__(self, parts: tuple[int, ...], note: str, heads: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.parts, self.note, self.heads = parts, note, heads

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        ranks = device_mesh.size()
        order = rank_major(self.parts, ranks, self.heads)
        for key, param in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(
                param.detach()[order], device_mesh, [Shard(0)], src_data_rank=self.src_data_rank
            )
            module.register_parameter(key, nn.Parameter(split, requires_grad=param.requires_grad))
        module.rank_major = order  # read by packed_rows: optimizer state dicts, pipeline checkpoints
        module.register_state_dict_post_hook(partial(_packed_state, order=order))
        module.register_load_state_dict_pre_hook(partial(_packed_load, order=order))
        copies = _copied(self.parts, self.heads, ranks, device_mesh.get_local_rank()) if self.heads else []
        if copies:
            summed = partial(_sum_copies, copies=copies, group=device_mesh.get_group())
            module.register_forward_pre_hook(partial(_sum_weight_grads, hook=summed))


def _copied(
    parts: tuple[int, ...], heads: tuple[int, ...], ranks: int, rank: int
) -> list[tuple[int, int, int, int]]:
    """The rows of ``rank``'s block that other ranks hold too: (offset, rows, head, heads) per copied part."""
    out, offset = [], 0
    for rows, g in zip(parts, heads, strict=True):
        local = rows // g * max(g // ranks, 1)
        if g < ranks:
            out.append((offset, local, rank * g // ranks, g))
        offset += local
    return out


def _sum_copies(grad: Tensor, copies: list[tuple[int, int, int, int]], group: dist.ProcessGroup) -> Tensor:
    """A packed projection's gradient with each copied head's rows summed over the ranks holding that head:
    each rank puts its copy's gradient in its head's slot of a zero buffer of every head, one all-reduce."""
    local = (grad.to_local() if isinstance(grad, DTensor) else grad).clone()
    for offset, rows, head, heads in copies:
        buf = local.new_zeros((heads, rows, *local.shape[1:]))
        buf[head] = local[offset : offset + rows]
        dist.all_reduce(buf, group=group)
        local[offset : offset + rows] = buf[head]
    if isinstance(grad, DTensor):
        return DTensor.from_local(
            local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
        )
    return local


def _reordered(value: Tensor, order: Tensor, back: bool, like: DTensor) -> DTensor:
    """``value`` (whole or a DTensor) put out of (``back``) or into the rank-major ``order``, laid out as the
    parameter ``like``: over its mesh with its placements (the tensor ranks', or under FSDP2 the data and
    tensor ranks' of a 2-D mesh)."""
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    rows = packed_order(whole.to(like.device), order, back)
    return distribute_tensor(rows, like.device_mesh, like.placements, src_data_rank=None)


def _packed_state(
    module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any, *, order: Tensor
) -> None:
    if _HELD.get():
        return
    for key, param in module.named_parameters(recurse=False):
        if prefix + key in state and isinstance(param, DTensor):
            state[prefix + key] = _reordered(state[prefix + key], order, True, param)


def _packed_load(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any, order: Tensor) -> None:
    if _HELD.get():
        return
    for key, param in module.named_parameters(recurse=False):
        if prefix + key in state and isinstance(param, DTensor):
            state[prefix + key] = _reordered(state[prefix + key], order, False, param)


class HeadSplit(ParallelStyle):
    """Tell an attention layer that it computes ``heads`` query and ``kv_heads`` key/value heads per rank.

    The QK-norms' weights, one for every head, stay whole on every rank; their gradients (each rank's from
    its own heads) are summed over the ranks.

    Args:
        heads: local query heads H / ranks.
        kv_heads: local key/value heads: Hkv / ranks, or 1 when each is held by several ranks.
        note: the description :func:`describe` prints.
    """

    def __init__(self, heads: int, kv_heads: int, note: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.note = heads, kv_heads, note

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Attention):
            raise TypeError(f"HeadSplit splits an attention layer, not {type(module).__name__}")
        ranks = device_mesh.size()
        kv = module.num_kv_heads // self.kv_heads  # a copied key/value head: 1 of Hkv, not Hkv / ranks
        module.num_heads, module.num_kv_heads = self.heads, self.kv_heads
        if hasattr(module, "parts"):  # (name, rows, bias) of the packed projection: this rank's rows
            module.parts = tuple(
                (name, rows // (kv if name in "kv" else ranks), bias) for name, rows, bias in module.parts
            )
        summed = partial(_summed, group=device_mesh.get_group())
        for norm in (
            module.q_norm,
            module.k_norm,
        ):  # one weight for every head: each rank's grad is its heads'
            norm.register_forward_pre_hook(partial(_sum_weight_grads, hook=summed))
        return module


def _sum_weight_grads(norm: nn.Module, args: Any, hook: Callable[[Tensor], Tensor]) -> None:
    """Before a QK-norm runs: the weights it is about to use sum their gradients over the tensor ranks (once
    per weight tensor). Hooked at forward time, not on the parameters: FSDP2 swaps in gathered weights (a 2-D
    mesh), whose gradients are the ones it then reduces over the data ranks."""
    for param in norm.parameters():
        if param.requires_grad and not getattr(param, "_specvit_summed", False):
            param.register_hook(hook)
            param._specvit_summed = True  # type: ignore[attr-defined]


def _summed(grad: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The gradient summed over the ranks of ``group``."""
    total = grad.clone()
    dist.all_reduce(total, group=group)
    return total


class ExpertSplit(ParallelStyle):
    """E / ranks whole experts of a :class:`~specvit.nn.moe.MoeMlp` per rank (``fc1``, ``fc2`` split by
    expert), their routed outputs summed over the ranks.

    Args:
        note: the description :func:`describe` prints.
    """

    def __init__(self, note: str) -> None:
        super().__init__()
        self.note = note

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoeMlp):
            raise TypeError(f"ExpertSplit splits a mixture of experts, not {type(module).__name__}")
        for key in ("fc1", "fc2"):
            param = getattr(module, key)
            split = distribute_tensor(
                param.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank
            )
            module.register_parameter(key, nn.Parameter(split, requires_grad=param.requires_grad))
        module.first_expert = device_mesh.get_local_rank() * (module.experts // device_mesh.size())
        module.group = device_mesh.get_group()
        return module


class TiedHead(ParallelStyle):
    """An LM head tied to a vocabulary-parallel embedding: column-wise by that split weight (its bias split
    alike), the logits gathered.

    Args:
        note: the description :func:`describe` prints.
    """

    def __init__(self, note: str) -> None:
        super().__init__()
        self.note = note

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if isinstance(module, TiedLinear) and module.bias is not None:
            split = distribute_tensor(
                module.bias.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank
            )
            module.register_parameter("bias", nn.Parameter(split))

    @staticmethod
    def _inputs(module: nn.Module, inputs: tuple[Any, ...], device_mesh: DeviceMesh) -> tuple[Any, ...]:
        return (DTensor.from_local(inputs[0], device_mesh, [Replicate()], run_check=False), *inputs[1:])

    @staticmethod
    def _outputs(module: nn.Module, out: Any, device_mesh: DeviceMesh) -> Tensor:
        return out.redistribute(placements=[Replicate()]).to_local()  # (B, S, V) on every rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)  # type: ignore[arg-type]  # hooks return the new inputs / output
