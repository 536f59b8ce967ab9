"""Tensor parallelism derived from a model's graph: which layer is split how, or why it cannot be.

:func:`plan` walks the graph's module nodes and reads each module's role from its kind (attention, MLP,
experts, token embedding, LM head), never from a family name, and returns a plan for
``torch.distributed.tensor.parallel.parallelize_module``:

- attention: query/key/value projections column-wise (a packed ``qkv`` or ``kv`` split per part, so each rank
  holds whole heads of each), the output projection row-wise (its outputs summed over the ranks), and the
  layer told its local head counts (H / ranks, Hkv / ranks); the key/value heads must divide over the ranks
  like the query heads (with fewer key/value heads than ranks, GQA and MQA are refused);
- MLPs: ``fc1`` column-wise (a gated MLP's packed gate and value each split), ``fc2`` row-wise;
- mixture of experts: E / ranks whole experts per rank, their outputs summed over the ranks; the router and
  a shared expert replicated;
- token embeddings vocabulary-parallel (rows split, each rank looks up its rows, summed); an LM head
  column-wise over the vocabulary, the logits gathered; a tied head uses the embedding's split weight, so the
  one parameter stays one (split once);
- everything else replicated: norms, positions, patch embeddings, routers, classifier heads.

Whatever cannot be split is refused up front, all at once, with its numbers (``heads 12 over 5 ranks``).
The styles are in :mod:`specvit.parallel_styles`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from specvit.errors import Location, Problem, SpecError
from specvit.nn.attention import Attention
from specvit.nn.embed import TokenEmbed
from specvit.nn.layers import Shared, TiedLinear
from specvit.nn.mlp import GluMlp, Mlp
from specvit.nn.moe import MoeMlp
from specvit.parallel_styles import Colwise, ExpertSplit, HeadSplit, PackedColwise, Rowwise, TiedHead

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from specvit.model import SpecModel

__all__ = ["Plan", "describe", "entry_pattern", "parallelize", "plan"]

Plan = dict[str, ParallelStyle]
"""Module path (``*`` for every block) -> its style, as ``parallelize_module`` takes it."""


@dataclass
class _Derivation:
    """What :func:`plan` collects while walking the graph: entries, refusals, and every count that must
    divide over the ranks (for the hint that names the rank counts that would do)."""

    model: SpecModel
    ranks: int
    entries: dict[str, ParallelStyle] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def refuse(self, path: str, message: str, hint: str) -> None:
        source = self.model.graph[path].get("source") if path in self.model.graph else None
        self.problems.append(Problem(path, message, hint, _location(source)))

    def divides(self, path: str, what: str, count: int, hint: str = "") -> bool:
        """``count`` splits evenly over the ranks, or a refusal naming both numbers (``hint``: another fix)."""
        self.counts.append(count)
        if count % self.ranks == 0:
            return True
        self.refuse(path, f"{what} {count} over {self.ranks} ranks", hint + _RANKS)
        return False

    def error(self) -> SpecError:
        """The refusals, those of repeated blocks once (``blocks.*``), the rank counts that would do named."""
        g = math.gcd(*self.counts) if self.counts else 1
        fits = ", ".join(str(r) for r in range(1, g + 1) if g % r == 0)
        seen: dict[tuple[str, str, str, str], Problem] = {}
        for p in self.problems:
            path = re.sub(r"\.blocks\.\d+\.", ".blocks.*.", p.path)
            hint = p.hint.replace(_RANKS, f"the rank counts dividing every split count: {fits}")
            seen.setdefault(
                (path, p.message, hint, str(p.location)), Problem(path, p.message, hint, p.location)
            )
        return SpecError(list(seen.values()))


_RANKS = "\x00ranks"  # replaced by the rank counts that fit once every count is known


def _location(source: str | None) -> Location | None:
    match = re.fullmatch(r"(.*):(\d+):(\d+)", source or "")
    return Location(match[1], int(match[2]), int(match[3])) if match else None


def _ports(model: SpecModel, path: str) -> set[str]:
    """The input ports wired into a graph node."""
    return {d["port"] for _, _, d in model.graph.nx.in_edges(path, data=True)}


_PER_HEAD_PARTS = {
    "cosine": "cosine attention's per-head logit scale",
    "talking_heads": "talking heads mix all heads",
    "relative": "a relative position bias table over all heads",
    "gated": "gated positional attention's per-head gates",
    "disentangled": "disentangled relative scores",
    "global_projection": "global tokens' own projections",
}


def _attention(d: _Derivation, path: str, attn: Attention) -> None:
    h, hkv, vd = attn.num_heads, attn.num_kv_heads, attn.v_head_dim
    copied = hkv < d.ranks and d.ranks % hkv == 0 and h % d.ranks == 0  # each key/value head on several ranks
    ok = d.divides(path, "heads", h) & (
        copied
        or d.divides(
            path, "key/value heads", hkv, f"a multiple of {hkv} ranks copies each key/value head; or "
        )
    )
    found = [why for name, why in _PER_HEAD_PARTS.items() if getattr(attn, name, None)]
    found += ["1x1-conv projections over a map"] * (attn.projection == "conv")
    found += ["no output projection to sum the heads"] * isinstance(attn.proj, nn.Identity)
    found += ["separate q/v biases of a bias-less qkv"] * any(hasattr(attn, f"{n}_bias") for n in "qkv")
    found += ["QK-norm over all heads at once"] * any(
        getattr(n, "heads", None) for n in (attn.q_norm, attn.k_norm)
    )
    ports = _ports(d.model, path)
    found += ["a per-head bias of all heads from outside the layer (ALiBi, T5 buckets)"] * ("bias" in ports)
    found += ["positions added to queries and keys only (DETR)"] * bool({"pos", "memory_pos"} & ports)
    for why in found:
        d.refuse(
            path,
            f"attention heads cannot be split: {why}",
            "no tensor parallelism for this spec: shard it with FSDP2 instead",
        )
    if not ok or found:
        return
    n = d.ranks
    local = 1 if copied else hkv // n  # key/value heads per rank
    norms = any(True for m in (attn.q_norm, attn.k_norm) for _ in m.parameters())
    note = f"heads {h} -> {h // n}, key/value heads {hkv} -> {local} per rank"
    note += f" (each on {n // hkv} ranks, its copies' gradients summed)" if copied else ""
    note += "; QK-norm weights whole, their gradients summed" if norms else ""
    d.entries[path] = HeadSplit(h // n, local, note)
    _projections(d, path, attn, copied)
    d.entries[f"{path}.proj"] = Rowwise(
        f"row-wise, columns {h * vd} -> {h * vd // n} per rank, outputs summed"
    )


def _projections(d: _Derivation, path: str, attn: Attention, copied: bool) -> None:
    """The entries of the query, key and value projections, packed or not; ``copied``: each key/value head
    is held by several ranks (one per rank, its rows placed by head)."""
    h, hkv, n = attn.num_heads, attn.num_kv_heads, d.ranks
    q, k, v = h * attn.head_dim, hkv * attn.head_dim, hkv * attn.v_head_dim
    kl, vl = (k // hkv, v // hkv) if copied else (k // n, v // n)
    by_head = "column-wise by head" if copied else "column-wise"
    if hasattr(attn, "qkv"):
        d.entries[f"{path}.qkv"] = PackedColwise(
            (q, k, v),
            f"{by_head}, packed q|k|v rows {q}|{k}|{v} -> {q // n}|{kl}|{vl} per rank",
            (h, hkv, hkv) if copied else None,
        )
        return
    d.entries[f"{path}.q"] = Colwise(f"column-wise, rows {q} -> {q // n} per rank")
    if hasattr(attn, "kv"):
        d.entries[f"{path}.kv"] = PackedColwise(
            (k, v),
            f"{by_head}, packed k|v rows {k}|{v} -> {kl}|{vl} per rank",
            (hkv, hkv) if copied else None,
        )
    elif copied:
        d.entries[f"{path}.k"] = PackedColwise((k,), f"{by_head}, rows {k} -> {kl} per rank", (hkv,))
        d.entries[f"{path}.v"] = PackedColwise((v,), f"{by_head}, rows {v} -> {vl} per rank", (hkv,))
    else:
        d.entries[f"{path}.k"] = Colwise(f"column-wise, rows {k} -> {kl} per rank")
        d.entries[f"{path}.v"] = Colwise(f"column-wise, rows {v} -> {vl} per rank")


def _mlp(d: _Derivation, path: str, mlp: Mlp | GluMlp) -> None:
    hidden = mlp.fc2.in_features
    ok = d.divides(path, "MLP hidden width", hidden)
    if getattr(mlp, "grid", None) is not None:
        d.refuse(
            path,
            "a depthwise conv over the MLP's hidden channels cannot be split yet",
            "no tensor parallelism for this spec: shard it with FSDP2 instead",
        )
        ok = False
    if mlp.norm is not None:
        d.refuse(
            path,
            "a norm over all the MLP's hidden channels cannot be split",
            "no tensor parallelism for this spec: shard it with FSDP2 instead",
        )
        ok = False
    if not ok:
        return
    n = d.ranks
    if isinstance(mlp, GluMlp):
        note = (
            f"column-wise, packed gate|value rows {hidden}|{hidden} -> {hidden // n}|{hidden // n} per rank"
        )
        d.entries[f"{path}.fc1"] = PackedColwise((hidden, hidden), note)
    else:
        d.entries[f"{path}.fc1"] = Colwise(f"column-wise, rows {hidden} -> {hidden // n} per rank")
    d.entries[f"{path}.fc2"] = Rowwise(
        f"row-wise, columns {hidden} -> {hidden // n} per rank, outputs summed"
    )


def _module_role(d: _Derivation, path: str, module: nn.Module, vocabs: set[int]) -> None:
    """The entries of one module node, by what the module is."""
    n = d.ranks
    if isinstance(module, Attention):
        _attention(d, path, module)
    elif isinstance(module, (Mlp, GluMlp)):
        _mlp(d, path, module)
    elif isinstance(module, MoeMlp):
        e = module.experts
        shared = "; the shared expert whole on every rank" if module.shared is not None else ""
        if d.divides(path, "experts", e):
            d.entries[path] = ExpertSplit(f"experts {e} -> {e // n} per rank, routed outputs summed" + shared)
    elif isinstance(module, TokenEmbed):
        v = module.num_embeddings
        if d.divides(path, "vocabulary", v, f"pad the vocabulary to a multiple of {n}; "):
            d.entries[path] = Rowwise(
                f"vocabulary-parallel, rows {v} -> {v // n} per rank, lookups summed", embedding=True
            )
    elif isinstance(module, TiedLinear):
        v = module.weight.shape[0]  # split with the embedding it is tied to (refused there if it cannot be)
        d.entries[path] = TiedHead(
            f"tied LM head: column-wise by the embedding's split rows ({v} -> {v // n}), logits gathered"
        )
    elif (
        isinstance(module, nn.Linear)
        and d.model.graph[path]["stack"] == "head"
        and module.out_features in vocabs
    ):
        v = module.out_features
        if d.divides(path, "vocabulary", v, f"pad the vocabulary to a multiple of {n}; "):
            d.entries[path] = Colwise(
                f"LM head column-wise, rows {v} -> {v // n} per rank, logits gathered", gather=True
            )


def plan(model: SpecModel, mesh: DeviceMesh | int) -> Plan:
    """The tensor-parallel plan of ``model`` over ``mesh``, derived from its graph (see the module docstring).

    Repeated blocks that are split alike share one entry with ``*`` for the block index. Modules without an
    entry are replicated.

    Args:
        model: a compiled model, not yet split.
        mesh: a 1-D device mesh (or just the number of ranks, to read a plan without a process group).

    Raises:
        SpecError: everything that cannot be split over that many ranks, each with the spec line of the
            layer, the numbers and the fix.
    """
    ranks = mesh if isinstance(mesh, int) else mesh.size()
    if ranks < 1:
        raise ValueError(f"tensor parallelism needs at least one rank, got {ranks}")
    d = _Derivation(model, ranks)
    graph, seen = model.graph, set()
    vocabs = {a["p"].vocab for _, a in graph.nx.nodes(data=True) if a["op"] == "token_embed"}
    for path, attrs in graph.nx.nodes(data=True):
        if not attrs["module"]:
            continue
        module = model.get_submodule(path)
        if isinstance(module, Shared) or id(module) in seen:  # applies another module: split there, once
            continue
        seen.add(id(module))
        _module_role(d, path, module, vocabs)
    if d.problems:
        raise d.error()
    return _fold(model, d.entries)


def _note(style: ParallelStyle) -> str:
    return str(getattr(style, "note", repr(style)))


def _fold(model: nn.Module, entries: Mapping[str, ParallelStyle]) -> Plan:
    """Entries of every block of a ``ModuleList`` that are alike, as one entry with ``*`` for the index."""
    groups: dict[tuple[str, str, str], list[tuple[int, str]]] = {}
    for path, style in entries.items():
        match = re.fullmatch(r"(.*\.blocks)\.(\d+)(\..*|)", path)
        if match:
            groups.setdefault((match[1], match[3], _note(style)), []).append((int(match[2]), path))
    folded: Plan = {}
    for path, style in entries.items():
        match = re.fullmatch(r"(.*\.blocks)\.(\d+)(\..*|)", path)
        if match:
            members = groups[(match[1], match[3], _note(style))]
            if len(members) == len(cast(nn.ModuleList, model.get_submodule(match[1]))) > 1:
                folded.setdefault(f"{match[1]}.*{match[3]}", style)
                continue
        folded[path] = style
    return folded


def entry_pattern(path: str) -> re.Pattern[str]:
    """A plan entry's path as a pattern of the module paths it covers (``*`` stands for any block index)."""
    return re.compile(re.escape(path).replace(r"\*", r"\d+"))


def describe(model: SpecModel, split: Plan) -> str:
    """The plan as text: one line per entry (path, then what is split), then the replicated modules.

    Args:
        model: the model the plan is for.
        split: the plan, from :func:`plan`.
    """
    width = max(len(p) for p in split) if split else 0
    lines = [f"{path.ljust(width)}  {_note(style)}" for path, style in split.items()]
    keys = [entry_pattern(p) for p in split]
    covered = [m for m, _ in model.named_modules() if any(k.fullmatch(m) for k in keys)]

    def split_in(path: str) -> bool:  # the module, a module inside it or one around it is split
        return any(c == path or c.startswith(path + ".") or path.startswith(c + ".") for c in covered)

    nodes = model.graph.nx.nodes(data=True)
    kept = [path for path, a in nodes if a["module"] and a["params"] and not split_in(path)]
    folded = list(dict.fromkeys(re.sub(r"\.blocks\.\d+\.", ".blocks.*.", p) for p in kept))
    return "\n".join([*lines, "replicated: " + (", ".join(folded) or "nothing")])


def parallelize(model: SpecModel, mesh: DeviceMesh) -> SpecModel:
    """Split ``model`` in place over ``mesh`` by :func:`plan` (``parallelize_module``).

    Every rank must hold the same weights (seed before building): the split parts are scattered from rank 0.

    Args:
        model: a compiled, materialised model, not wrapped and not split yet.
        mesh: a 1-D device mesh.

    Raises:
        SpecError: what cannot be split (see :func:`plan`), before anything is changed.
        TypeError: when the model is already split.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if getattr(model, "tensor_parallel", None):
        raise TypeError(f"the model is already split over {model.tensor_parallel} ranks")
    parallelize_module(model, mesh, plan(model, mesh))
    object.__setattr__(model, "tensor_parallel", mesh.size())
    return model
