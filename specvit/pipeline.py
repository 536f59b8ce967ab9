"""Pipeline parallelism derived from the graph: a model cut into stages at block boundaries, run by
``torch.distributed.pipelining`` schedules.

:func:`split` traces the compiled forward with ``torch.fx`` (blocks and module nodes as leaves, so a block's
own control flow, such as a mixture-of-experts' data-dependent routing, is never traced), gives every traced
node the stage :func:`~specvit.parallel_layout.pipeline_stages` gives its block (FLOPs-balanced, an
encoder-decoder's boundary a cut, the cuts ``summary --pp`` and ``render --pp`` show), and makes one
``fx.GraphModule`` per stage. A stage takes the values live at its entry (the model's inputs for the first)
and returns those live at its exit: its own outputs, and every earlier value a later stage reads, relayed
(token ids for a decoder's first stage, an encoder's memory for every decoder stage, rotary tables). Tuples
(rotary tables) cross as their tensors, a dict output (an MoE model's ``router_loss``) as its values. A
stage's modules are the model's own at the model's paths, so its ``state_dict`` keys are the model's.

A weight used by more than one stage (a tied LM head, an encoder-decoder's shared embedding) is held by each
of them, as Megatron-LM holds a tied embedding on the first and the last stage: :class:`Pipeline` sums its
gradients over those stages before the optimizer step, so the copies stay equal.

Running the stages one after another in one process is the model's forward (:func:`run_split`).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor, nn

from specvit.codegen.build import helper_names
from specvit.errors import Problem, SpecError
from specvit.model import Block, SpecModel
from specvit.parallel_layout import pipeline_stages

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = ["SCHEDULES", "Pipeline", "Stage", "run_split", "split"]

SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""``1f1b`` and ``gpipe``: one stage per rank; ``interleaved``: ``stages_per_rank`` stages per rank
(``ScheduleInterleaved1F1B``, stage ``i`` on rank ``i % ranks``)."""


class _Tracer(fx.Tracer):
    """Blocks and module nodes are leaves; the generated helpers are called, not traced."""

    def __init__(self, model: SpecModel):
        super().__init__(autowrap_functions=tuple(helper_names(model.graph).values()))
        self.leaves = set(model.graph.module_nodes())

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Block) or qualname in self.leaves


@dataclass
class Stage:
    """One stage of a split model.

    Attributes:
        module: the stage's forward, an ``fx.GraphModule`` over the model's own modules at the model's paths.
        blocks: the blocks it runs.
        inputs: the values it takes, by their traced names (a tuple as one name per tensor).
        outputs: the values it returns, by their traced names; for the last stage, the keys of the model's
            output when that is a dict (returned as the tuple of its values: :meth:`output` makes the dict).
        shared: the parameters it uses that another stage uses too, by their names in the model.
    """

    module: fx.GraphModule
    blocks: tuple[str, ...]
    inputs: list[str]
    outputs: list[str]
    shared: dict[str, nn.Parameter] = field(default_factory=dict)

    def output(self, value: Any) -> Any:
        """The last stage's return value as the model returns it (a dict from the tuple of its values)."""
        if self.outputs and isinstance(value, tuple):
            return dict(zip(self.outputs, value, strict=True))
        return value


def _trace(model: SpecModel, inputs: Sequence[str]) -> fx.Graph:
    """The model's forward with the arguments outside ``inputs`` fixed at their defaults."""
    params = inspect.signature(model.forward).parameters
    unknown = [n for n in inputs if n not in params]
    if unknown:
        raise TypeError(f"inputs: {unknown} are not arguments of the model's forward {list(params)}")
    fixed = {n: p.default for n, p in params.items() if n not in inputs}
    missing = [n for n, v in fixed.items() if v is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"inputs: the model's required argument(s) {missing} must be among the inputs")
    graph = _Tracer(model).trace(model, concrete_args=fixed)
    doomed: list[fx.Node] = []  # the fixed arguments' placeholders, and the checks fx adds on them
    for node in graph.nodes:
        if (node.op == "placeholder" and node.target not in inputs) or (
            node.op == "call_function" and node.all_input_nodes and set(node.all_input_nodes) <= set(doomed)
        ):
            doomed.append(node)
    for node in reversed(doomed):
        graph.erase_node(node)
    return graph


def _stages_of(graph: fx.Graph, model: SpecModel, plan: list[set[str]]) -> dict[fx.Node, int]:
    """Each traced node's stage: a module node's or block's from ``plan`` (the graph nodes and blocks of each
    stage), any other node the latest among its inputs' (the first for placeholders, the last for the output).

    Raises:
        SpecError: a node reading a value of a later stage (a forward that does not run in stage order).
    """
    where = {path: k for k, paths in enumerate(plan) for path in paths}
    stage: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "call_module" and str(node.target) in where:
            stage[node] = where[str(node.target)]
        elif node.op == "output":
            stage[node] = len(plan) - 1
        else:
            stage[node] = max((stage[i] for i in node.all_input_nodes), default=0)
        late = [i for i in node.all_input_nodes if stage[i] > stage[node]]
        if late:
            raise SpecError(
                Problem(
                    "",
                    f"{model.graph.name}: {node.name} on pipeline stage {stage[node]} reads {late[0].name} "
                    f"of stage {stage[late[0]]}: the forward does not run in these stages' order",
                    "use fewer pipeline stages",
                )
            )
    return stage


def _arity(model: SpecModel, node: fx.Node) -> int:
    """How many tensors a value is: n for a module node returning ``tuple[Tensor, ...]`` (rotary tables), or 1."""
    target = str(node.target)
    if node.op == "call_module" and target in model.graph.nx:
        kind = str(model.graph.op(target).value)
        if kind.startswith("tuple["):
            return kind.count("Tensor")
    return 1


def _names(node: fx.Node, arity: int) -> list[str]:
    return [node.name] if arity == 1 else [f"{node.name}_{i}" for i in range(arity)]


def _live(graph: fx.Graph, stage: dict[fx.Node, int], k: int) -> list[fx.Node]:
    """The values of stages 0..k that a later stage reads, in program order."""
    return [
        n for n in graph.nodes if n.op != "output" and stage[n] <= k and any(stage[u] > k for u in n.users)
    ]


def _stage(model: SpecModel, graph: fx.Graph, stage: dict[fx.Node, int], k: int, last: int) -> Stage:
    """Stage ``k``'s forward: placeholders for the values live at its entry, its nodes, its live exit values."""
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    inputs: list[str] = []
    entry = [n for n in graph.nodes if n.op == "placeholder"] if k == 0 else _live(graph, stage, k - 1)
    for value in entry:
        names = _names(value, _arity(model, value))
        made = tuple(g.placeholder(name) for name in names)
        env[value] = made[0] if len(made) == 1 else made
        inputs += names
    outputs: list[str] = []
    for node in graph.nodes:
        if node.op == "output" and k == last:
            result = fx.map_arg(node.args[0], lambda a: env[a])
            if isinstance(result, dict):  # schedules pass tensors and tuples
                outputs, result = list(result), tuple(result.values())
            g.output(result)
        elif node.op not in ("placeholder", "output") and stage[node] == k:
            env[node] = g.node_copy(node, lambda a: env[a])
    if k < last:
        flat: list[Any] = []
        for value in _live(graph, stage, k):
            arity = _arity(model, value)
            v = env[value]
            flat += [v] if arity == 1 else [g.call_function(operator.getitem, (v, i)) for i in range(arity)]
            outputs += _names(value, arity)
        g.output(tuple(flat))
    module = fx.GraphModule(model, g, class_name=f"Stage{k}")  # the modules g calls, at their paths
    _add_lenders(model, module)
    return Stage(module, (), inputs, outputs)


def _lender(module: nn.Module) -> nn.Module | None:
    """The module whose weights a ``Shared`` or ``TiedLinear`` layer applies (held unregistered, ``_source``)."""
    source = getattr(module, "_source", None)
    return source[0] if isinstance(source, tuple) and source and isinstance(source[0], nn.Module) else None


def _add_lenders(model: SpecModel, stage: fx.GraphModule) -> None:
    """Register on ``stage``, at their model paths, the modules its layers borrow weights from (a tied head's
    embedding), so that the stage's parameters are every weight it uses."""
    paths = {id(m): name for name, m in model.named_modules()}
    for node in stage.graph.nodes:
        if node.op != "call_module":
            continue
        for sub in stage.get_submodule(str(node.target)).modules():
            lender = _lender(sub)
            if lender is None:
                continue
            *parents, name = paths[id(lender)].split(".")
            at: nn.Module = stage
            for part in parents:
                if not hasattr(at, part):
                    at.add_module(part, nn.Module())
                at = getattr(at, part)
            at.add_module(name, lender)


def _mark_shared(model: nn.Module, stages: list[Stage]) -> None:
    """Record on each stage the parameters it shares with another stage, by their names in the model."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    held = [{id(p) for p in s.module.parameters()} for s in stages]
    for s in stages:
        s.shared = {canonical[id(p)]: p for p in s.module.parameters() if sum(id(p) in h for h in held) > 1}


def split(model: SpecModel, stages: int, inputs: Sequence[str] | None = None) -> list[Stage]:
    """Cut ``model`` into ``stages`` pipeline stages at block boundaries, balanced by the graph's FLOPs.

    Args:
        model: a compiled model.
        stages: the number of stages (at most the number of blocks; each holds blocks of one stack).
        inputs: the forward's arguments the first stage takes, in order (default: the required ones); the
            others are fixed at their defaults (no cache, offset 0).

    Raises:
        SpecError: a number of stages the blocks do not allow.
        TypeError: ``inputs`` that are not the forward's arguments, or leave out a required one.
    """
    params = inspect.signature(model.forward).parameters
    if inputs is None:
        inputs = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
    graph = _trace(model, inputs)
    costs = pipeline_stages(model.graph, stages)
    stage = _stages_of(graph, model, [set(c.nodes) | set(c.blocks) for c in costs])
    out = []
    for k, cost in enumerate(costs):
        s = _stage(model, graph, stage, k, stages - 1)
        s.blocks = cost.blocks
        out.append(s)
    _mark_shared(model, out)
    return out


def run_split(stages: Sequence[Stage], *inputs: Tensor) -> Any:
    """Run the stages one after another in this process: the model's forward on ``inputs``."""
    values: tuple[Any, ...] = inputs
    for s in stages[:-1]:
        values = s.module(*values)
    return stages[-1].output(stages[-1].module(*values))


class Pipeline:
    """This rank's stages of a model split for pipeline parallelism, and their schedule.

    Every rank builds the same model (same seed, or the same weights loaded), then uses only its stages'
    modules (:meth:`parameters`, :meth:`state_dict`). :meth:`step` runs a batch's forward and backward as
    ``microbatches`` equal slices and leaves the gradients of the mean of their losses, as one process
    computes them, on every rank's weights.

    Args:
        model: the compiled model, the same on every rank of ``group``.
        loss_fn: ``loss_fn(output, target)``: one microbatch's loss from the model's output and the target's
            slice.
        microbatches: slices per batch (the batch's first dimension must divide by it).
        schedule: one of :data:`SCHEDULES`.
        stages_per_rank: stages on each rank (more than 1 with ``interleaved`` only).
        inputs: the forward's arguments :meth:`step` passes, in order (default: the required ones).
        group: the pipeline's process group (default: every rank).
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
        device = next(model.parameters()).device
        runs = [_stage_class()(every[i].module, i, count, device, group=group) for i in indices]
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
        dist.broadcast(
            loss, dist.get_global_rank(self.group, self.last) if self.group else self.last, self.group
        )
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
                _local(grad) if grad is not None else torch.zeros_like(_local(p)), group=self.group
            )

    def _names(self) -> dict[int, str]:
        """Each parameter of this rank's stages -> its name in the model."""
        return {id(p): name for s in self.stages for name, p in s.module.named_parameters()}

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The whole model's weights and ``optimizer``'s state keyed by parameter name, as one process holds
        them, on the group's rank 0 (empty elsewhere): a collective, every rank of the group calls it.

        Args:
            optimizer: the optimizer over :meth:`parameters`.
        """
        names = self._names()
        weights = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        state = {
            names[id(p)]: {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in st.items()}
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

    def load_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load into ``optimizer`` (over :meth:`parameters`) this rank's part of a whole optimizer state keyed
        by parameter name (:meth:`full_state`, or one process's, saved in any layout).

        Args:
            optimizer: the optimizer.
            state: ``{"state": {name: {...}}, "param_groups": [...]}``.
        """
        names = self._names()
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for p in self.parameters():
            saved = state["state"].get(names[id(p)])
            if saved is not None:
                optimizer.state[p] = {
                    k: v.to(p.device) if isinstance(v, Tensor) else v for k, v in saved.items()
                }

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


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
