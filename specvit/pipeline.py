"""Pipeline parallelism derived from the graph: a model cut into stages at block boundaries
(:mod:`specvit.pipeline_split`), run by ``torch.distributed.pipelining`` schedules.

:class:`Pipeline` keeps this rank's stages, with real weights for them only: a model built on the meta
device has its stages' weights materialised and drawn as a one-process build draws them under the same seed,
a built model has the other stages' weights dropped. A weight several stages use (a tied LM head, shared
embeddings) is held by each of them, as Megatron-LM holds a tied embedding on its first and last stage;
its gradients are summed over those stages before the optimizer step, so the copies stay equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from specvit.model import SpecModel
from specvit.pipeline_split import Stage, mark_shared, run_split, split

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = ["SCHEDULES", "Pipeline", "Stage", "run_split", "split"]

SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""``1f1b`` and ``gpipe``: one stage per rank; ``interleaved``: ``stages_per_rank`` stages per rank
(``ScheduleInterleaved1F1B``, stage ``i`` on rank ``i % ranks``)."""


class Pipeline:
    """This rank's stages of a model split for pipeline parallelism, and their schedule.

    Every rank builds the same model, on the meta device (this rank's stages' weights are then materialised
    on ``device`` and initialised as :meth:`~specvit.model.SpecModel.init_weights` on a one-process build
    under the same seed initialises them) or materialised (same seed, or the same weights loaded: the other
    stages' weights are then dropped to the meta device). :meth:`step` runs a batch's forward and backward as
    ``microbatches`` equal slices and leaves the gradients of the mean of their losses, as one process
    computes them, on this rank's weights (:meth:`parameters`).

    Args:
        model: the compiled model, the same on every rank of ``group``.
        loss_fn: ``loss_fn(output, target)``: one microbatch's loss from the model's output and the target's
            slice.
        microbatches: slices per batch (the batch's first dimension must divide by it).
        schedule: one of :data:`SCHEDULES`.
        stages_per_rank: stages on each rank (more than 1 with ``interleaved`` only).
        inputs: the forward's arguments :meth:`step` passes, in order (default: the required ones).
        group: the pipeline's process group (default: every rank).
        device: where this rank's stages compute (default: the model's device, or the CPU for a meta build).
        data: the data ranks' mesh (a rank's peers holding the same stages): each stage's blocks and the rest
            of it sharded over them with FSDP2, as :func:`specvit.parallel.shard` shards a model.
    """

    def __init__(
        self,
        model: SpecModel,
        loss_fn: Callable[[Any, Tensor], Tensor],
        *,
        microbatches: int,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        inputs: Sequence[str] | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        data: DeviceMesh | None = None,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if stages_per_rank != 1 and schedule != "interleaved":
            raise ValueError(f"stages_per_rank={stages_per_rank} needs schedule='interleaved'")
        self.group = group
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.microbatches = microbatches
        count = self.ranks * stages_per_rank
        every = split(model, count, inputs)
        indices = range(self.rank, count, self.ranks)
        self.stages = [every[i] for i in indices]
        self.last = (count - 1) % self.ranks  # the group rank of the last stage
        here = next(model.parameters()).device
        meta = here.type == "meta"
        self.device = torch.device(device) if device is not None else torch.device("cpu") if meta else here
        _keep_only(model, self.stages, self.device)
        if data is not None:
            from specvit.parallel import shard_blocks

            for s in self.stages:
                shard_blocks(s.module, data)
        self.data = data
        mark_shared(model, every)  # the parameters of this rank's stages are new objects
        runs = [_stage_class()(every[i].module, i, count, self.device, group=group) for i in indices]
        last = every[-1]
        self.schedule = _schedule(schedule, runs, microbatches, lambda out, y: loss_fn(last.output(out), y))
        self._shared = _shared_by_rank(every, self.ranks)

    def parameters(self) -> list[nn.Parameter]:
        """The weights of this rank's stages, each once."""
        seen: dict[int, nn.Parameter] = {}
        for s in self.stages:
            for p in s.module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's weights, under their names in the model."""
        out: dict[str, Tensor] = {}
        for s in self.stages:
            out.update(s.module.state_dict())
        return out

    def step(self, *inputs: Tensor, target: Tensor) -> float:
        """One forward and backward of a batch through the pipeline; the batch's mean loss, on every rank.

        Args:
            inputs: the batch's inputs (read on the rank of the first stage).
            target: the batch's target (read on the rank of the last stage).
        """
        losses: list[Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.rank == self.last else {}
        self.schedule.step(*(inputs if self.rank == 0 else ()), return_outputs=False, **kwargs)
        self._finish_grads()
        loss = torch.stack(losses).mean().detach().float() if losses else torch.zeros(())
        dist.broadcast(loss, self._global(self.last), self.group)
        return float(loss)

    def _finish_grads(self) -> None:
        """Divide the gradients by the microbatches, once per weight (a schedule scales each stage's, so twice
        a weight two stages of one rank share), then sum over the ranks those of weights several ranks hold
        (zeros from the others), so that every copy takes the whole weight's gradient. A tensor-parallel
        weight's shards are summed with the same shards of the other stages."""
        for p in self.parameters():
            if p.grad is not None:
                p.grad.div_(self.microbatches)
        mine = {name for s in self.stages for name in s.shared}
        for name, p in self._shared.items():
            grad = p.grad if name in mine else None
            if grad is not None:
                grad = p.grad = _placed_as(grad, p)
            dist.all_reduce(
                _local(grad)
                if grad is not None
                else torch.zeros(self._held(p), dtype=p.dtype, device=self.device),
                group=self.group,
            )

    def _held(self, p: Tensor) -> torch.Size:
        """The shape of the part of weight ``p`` a rank of this rank's data and tensor coordinates holds."""
        shape = _local(p).shape  # a tensor-parallel weight's shard
        if self.data is None:
            return shape
        rows = torch.chunk(torch.empty(shape[0], device="meta"), self.data.size())  # FSDP2's dim-0 shards
        r = self.data.get_local_rank()
        return torch.Size((rows[r].shape[0] if r < len(rows) else 0, *shape[1:]))

    def _names(self) -> dict[int, str]:
        """Each parameter of this rank's stages -> its name in the model."""
        return {id(p): name for s in self.stages for name, p in s.module.named_parameters()}

    def _rows(self) -> dict[str, Tensor]:
        """Each tensor-parallel packed projection's parameter of this rank's stages -> its rank-major rows."""
        from specvit.parallel_styles import packed_rows

        return {name: order for s in self.stages for name, order in packed_rows(s.module).items()}

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The whole model's weights and ``optimizer``'s state keyed by parameter name, as one process holds
        them, on the group's rank 0 (empty elsewhere): a collective, every rank of the group calls it.

        Args:
            optimizer: the optimizer over :meth:`parameters`.
        """
        from specvit.parallel_styles import held_order

        names, rows = self._names(), self._rows()
        with held_order():  # packed weights as their ranks hold them, put in order as their states are
            weights = {k: _whole(v, rows.get(k)) for k, v in self.state_dict().items()}
        state = {
            names[id(p)]: {
                k: _whole(v, rows.get(names[id(p)])) if isinstance(v, Tensor) else v for k, v in st.items()
            }
            for p, st in optimizer.state.items()
        }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        parts: list[Any] | None = [None] * self.ranks if self.rank == 0 else None
        dist.gather_object((weights, state, groups), parts, dst=self._global(0), group=self.group)
        if parts is None:
            return {}, {}
        merged: dict[str, Any] = {"state": {}, "param_groups": [dict(g, params=[]) for g in groups]}
        for w, st, gs in parts:
            weights.update(w)
            merged["state"].update(st)
            for into, g in zip(merged["param_groups"], gs, strict=True):
                into["params"] += [n for n in g["params"] if n not in into["params"]]
        return weights, merged

    def load_state(
        self,
        weights: dict[str, Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """Load this rank's part of a whole model's weights, and of a whole optimizer state keyed by parameter
        name (:meth:`full_state`'s, or one process's, saved in any layout).

        Args:
            weights: the model's state dict.
            optimizer: the optimizer over :meth:`parameters`.
            state: its state, ``{"state": {name: {...}}, "param_groups": [...]}``.
        """
        rows = self._rows()
        with torch.no_grad():
            for s in self.stages:
                for name, p in s.module.named_parameters():  # each rank's part, whatever splits or shards it
                    _local(p).copy_(_local(_part(weights[name], p, rows.get(name))))
                for name, b in s.module.named_buffers():
                    if name in weights:  # persistent ones
                        b.copy_(weights[name])
        if optimizer is None or state is None:
            return
        names = self._names()
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for p in self.parameters():
            saved = state["state"].get(names[id(p)])
            if saved is not None:
                order = rows.get(names[id(p)])
                optimizer.state[p] = {
                    k: _part(v, p, order) if isinstance(v, Tensor) and v.dim() else v
                    for k, v in saved.items()
                }

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


def _keep_only(model: SpecModel, stages: list[Stage], device: torch.device) -> None:
    """Make ``stages``' weights real and every other weight of ``model`` meta: a meta build's stage weights
    materialised on ``device`` and initialised (:meth:`~specvit.model.SpecModel.init_weights` draws the
    others on scratch tensors, so the random stream is a one-process build's), a built model's others dropped."""
    mine = {id(p) for s in stages for p in s.module.parameters()}
    build = any(p.is_meta for p in model.parameters() if id(p) in mine)
    # id -> (the old parameter, kept alive so that no new one takes its id; the new one)
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    new: set[int] = set()
    for m in [*model.modules(), *(sub for s in stages for sub in s.module.modules())]:
        for name, p in list(m._parameters.items()):
            if p is None or id(p) in new or (id(p) in mine) != build:
                continue
            if id(p) not in made:
                value = torch.empty_like(p, device=device) if build else p.detach().to("meta")
                made[id(p)] = (p, nn.Parameter(value, requires_grad=p.requires_grad))
                new.add(id(made[id(p)][1]))
            m._parameters[name] = made[id(p)][1]
    if build:
        model.init_weights()


def _whole(t: Tensor, order: Tensor | None = None) -> Tensor:
    """A weight or optimizer state whole on the CPU, in one process's order (a collective for a split or
    sharded one: its ranks call it). ``order``: the rank-major rows of a packed projection's weight."""
    from torch.distributed.tensor import DTensor

    from specvit.parallel_styles import packed_order

    whole = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
    return packed_order(whole, order, back=True) if order is not None else whole


def _part(whole: Tensor, like: Tensor, order: Tensor | None = None) -> Tensor:
    """The part of a whole tensor in one process's order that ``like`` (a weight, plain, split over the tensor
    ranks or sharded over the data ranks) holds. ``order``: the rank-major rows of a packed projection's
    weight, which its ranks hold in that order."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from specvit.parallel_styles import packed_order

    whole = whole.to(_local(like).device)
    if order is not None:
        whole = packed_order(whole, order, back=False)
    if isinstance(like, DTensor):
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
    return whole


def _placed_as(grad: Tensor, param: Tensor) -> Tensor:
    """A tensor-parallel weight's gradient laid out as the weight (a vocabulary-parallel embedding's can come
    back replicated); a plain gradient itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _local(t: Tensor) -> Tensor:
    """A tensor-parallel weight's (or gradient's) shard on this rank; a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@cache
def _stage_class() -> type:
    """``PipelineStage`` whose shape inference runs a stage on zeros rather than uninitialised memory: a
    stage that embeds relayed token ids (an encoder-decoder's decoder) needs ids within its vocabulary."""
    from torch.distributed.pipelining import PipelineStage

    class ZeroedStage(PipelineStage):
        def _to_tensor(self, arg: Any) -> Tensor:
            t = super()._to_tensor(arg)
            if not isinstance(arg, Tensor):  # made from metadata
                with torch.no_grad():
                    t.zero_()
            return t

    return ZeroedStage


def _schedule(
    kind: str, runs: list[Any], microbatches: int, loss_fn: Callable[..., Tensor]
) -> _PipelineSchedule:
    """The schedule ``kind`` over this rank's stages; gradients left unscaled (:meth:`Pipeline._finish_grads`)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if kind == "interleaved":
        return ScheduleInterleaved1F1B(runs, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    single = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    return single(runs[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def _shared_by_rank(stages: list[Stage], ranks: int) -> dict[str, nn.Parameter]:
    """The weights held by stages on more than one rank (stage ``i`` on rank ``i % ranks``), by name in one
    order on every rank: each rank's copy, whether its stages use it or not (every rank built the model)."""
    held: dict[str, set[int]] = {}
    found: dict[str, nn.Parameter] = {}
    for i, s in enumerate(stages):
        for name, p in s.shared.items():
            held.setdefault(name, set()).add(i % ranks)
            found[name] = p
    return {name: found[name] for name in sorted(held) if len(held[name]) > 1}
