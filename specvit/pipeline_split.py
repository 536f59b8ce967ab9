"""A model cut into pipeline stages at block boundaries, from its graph (see :mod:`specvit.pipeline`).

:func:`split` traces the compiled forward with ``torch.fx`` (blocks and module nodes as leaves, so a block's
own control flow, such as a mixture-of-experts' data-dependent routing, is never traced), gives every traced
node the stage :func:`~specvit.parallel_layout.pipeline_stages` gives its block (balanced by FLOPs, then
parameters, an encoder-decoder's boundary a cut, the cuts ``summary --pp`` and ``render --pp`` show), and
makes one ``fx.GraphModule`` per stage. A stage takes the values live at its entry (the model's inputs for the first)
and returns those live at its exit: its own outputs, and every earlier value a later stage reads, relayed
(token ids for a decoder's first stage, an encoder's memory for every decoder stage, rotary tables). Tuples
(rotary tables) cross as their tensors, a dict output (an MoE model's ``router_loss``) as its values. A
stage's modules are the model's own at the model's paths, so its ``state_dict`` keys are the model's; a
weight several stages use (a tied LM head, shared embeddings) is held by each (:attr:`Stage.shared`).

Running the stages one after another in one process is the model's forward (:func:`run_split`).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import Tensor, nn

from specvit.codegen.build import helper_names
from specvit.errors import Problem, SpecError
from specvit.model import Block, SpecModel
from specvit.nn.layers import lender as borrowed
from specvit.parallel_layout import pipeline_stages

__all__ = ["Stage", "mark_shared", "run_split", "split"]


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


def _add_lenders(model: SpecModel, stage: fx.GraphModule) -> None:
    """Register on ``stage``, at their model paths, the modules its layers borrow weights from (a tied head's
    embedding), so that the stage's parameters are every weight it uses."""
    paths = {id(m): name for name, m in model.named_modules()}
    for node in stage.graph.nodes:
        if node.op != "call_module":
            continue
        for sub in stage.get_submodule(str(node.target)).modules():
            lender = borrowed(sub)
            if lender is None:
                continue
            *parents, name = paths[id(lender)].split(".")
            at: nn.Module = stage
            for part in parents:
                if not hasattr(at, part):
                    at.add_module(part, nn.Module())
                at = getattr(at, part)
            at.add_module(name, lender)


def mark_shared(model: nn.Module, stages: list[Stage]) -> None:
    """Record on each stage the parameters it shares with another stage, by their names in the model."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    held = [{id(p) for p in s.module.parameters()} for s in stages]
    for s in stages:
        s.shared = {canonical[id(p)]: p for p in s.module.parameters() if sum(id(p) in h for h in held) > 1}


def split(model: SpecModel, stages: int, inputs: Sequence[str] | None = None) -> list[Stage]:
    """Cut ``model`` into ``stages`` pipeline stages at block boundaries, balanced by FLOPs, then parameters.

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
    mark_shared(model, out)
    return out


def run_split(stages: Sequence[Stage], *inputs: Tensor) -> Any:
    """Run the stages one after another in this process: the model's forward on ``inputs``."""
    values: tuple[Any, ...] = inputs
    for s in stages[:-1]:
        values = s.module(*values)
    return stages[-1].output(stages[-1].module(*values))
