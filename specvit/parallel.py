"""Training past one process: FSDP2 sharding, tensor-parallel plans, full state dicts, memory per rank.

:func:`shard` applies PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) to every block of every
stack, then to the root, whose group holds the rest: embeddings, prefix tokens, positions, final norms
and the head. Tied LM heads (:class:`~specvit.model.TiedLinear`) and shared embeddings
(:class:`~specvit.model.SharedEmbedding`) only hold a reference to a ``TokenEmbed`` of a stack, never
inside a block, so the one weight they share lives in the root group and is gathered once per forward.

Tensor parallelism: :func:`plan` derives a ``torch.distributed.tensor.parallel`` plan from the model's graph
and :func:`parallelize` applies it (both in :mod:`specvit.tensor_parallel`).

DDP needs nothing from here: wrap the plain model in ``torch.nn.parallel.DistributedDataParallel``.
See ``docs/distributed.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from specvit.model import Block, SpecModel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ParallelStyle

    from specvit.spec.schema import Spec

__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "MemoryEstimate",
    "default_mesh",
    "full_state_dict",
    "load_full_state_dict",
    "load_optimizer_state_dict",
    "memory_estimate",
    "memory_table",
    "optimizer_state_dict",
    "parallelize",
    "plan",
    "shard",
    "shard_blocks",
]

ADAMW_BYTES_PER_PARAM = 16
"""fp32 training with AdamW: parameter 4, gradient 4, ``exp_avg`` 4, ``exp_avg_sq`` 4 bytes."""


def _device_type() -> str:
    """The device type of the default process group's backend: ``cpu`` for gloo, ``cuda`` for nccl."""
    backend = str(dist.get_backend())
    if ":" in backend:  # a per-device backend string, e.g. "cpu:gloo,cuda:nccl": prefer the accelerator
        devices = [part.split(":")[0] for part in backend.split(",")]
        return next((d for d in devices if d != "cpu"), "cpu")
    devices = [d for d, b in dist.Backend.default_device_backend_map.items() if b == backend]
    return devices[0] if devices else "cpu"


def default_mesh() -> DeviceMesh:
    """A 1-D device mesh over every rank of the default process group.

    Raises:
        RuntimeError: when no process group is initialised (start under ``torchrun`` and call
            ``torch.distributed.init_process_group()`` first).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "specvit.parallel needs a process group: run under torchrun and call "
            "torch.distributed.init_process_group() first, or pass a mesh"
        )
    return init_device_mesh(_device_type(), (dist.get_world_size(),))


def shard(
    model: SpecModel,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> SpecModel:
    """Shard ``model`` in place with FSDP2: each block of each stack is one group, the root the last.

    Works on a model built on the meta device (then ``model.to_empty(device=...)`` and
    ``model.init_weights()``, which gives every rank its shard of the same weights a single-process
    build has under the same ``torch.manual_seed``) as on a materialised one (each rank keeps its shard
    of the weights it has, which must be the same on every rank: seed before building).

    Args:
        model: a compiled model, not wrapped (no DDP, not already sharded).
        mesh: the device mesh to shard over; default :func:`default_mesh`, every rank of the default
            process group.
        reshard_after_forward: free each block's gathered parameters after its forward and gather them
            again for the backward (less memory), or keep them until the backward (less communication).
            The root group is never resharded between forward and backward.
        mp_policy: FSDP2 mixed precision, e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``: compute in bf16, keep sharded parameters, gradients and
            optimizer states in the parameters' dtype. Default: compute in the parameters' dtype.

    Raises:
        TypeError: when ``model`` is not a :class:`~specvit.model.SpecModel`, or is already sharded.
        RuntimeError: without a mesh and without a process group.

    Returns:
        The same model object, now also an ``FSDPModule`` (``model.unshard()``, ``model.reshard()``).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, SpecModel):
        raise TypeError(f"shard() takes a specvit model, got {type(model).__name__} (unwrap it first)")
    if isinstance(model, FSDPModule):
        raise TypeError("the model is already sharded")
    shard_blocks(model, mesh if mesh is not None else default_mesh(), reshard_after_forward, mp_policy)
    return model


def shard_blocks(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """FSDP2 on every block inside ``module`` (a model, or a pipeline stage), then on ``module`` itself.

    Args:
        module: the module whose blocks and remaining weights are sharded, in place.
        mesh: the data ranks' mesh.
        reshard_after_forward: as :func:`shard`'s.
        mp_policy: as :func:`shard`'s.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in [m for m in module.modules() if isinstance(m, Block)]:  # every stack (and stage)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole, unsharded state dict of a plain, DDP-wrapped, FSDP2-sharded or tensor-parallel model (or
    both), on the CPU, as one process holds it.

    A collective under a process group: every rank must call it. The full dict comes back on rank 0
    only, other ranks get ``{}``; save it from rank 0 with ``model.save_pretrained(dir, state_dict=...)``.
    Keys are those of the plain model (no ``module.`` prefix of DDP). A tensor-parallel packed projection is
    gathered as its ranks hold it and put back in one process's packed order (:func:`~specvit.parallel_styles.
    packed_order`), as :func:`optimizer_state_dict` puts back its AdamW moments. For a model that is not
    sharded the other tensors are the live parameters themselves, not copies: save (or clone) before the next
    step.

    Args:
        model: the model, as trained (sharded, wrapped or plain).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from specvit.parallel_styles import held_order, packed_rows

    with held_order():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _in_order(
        {name: value for name, value in state.items() if isinstance(value, Tensor)}, packed_rows(model), True
    )


def load_full_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a whole state dict in one process's order (:func:`full_state_dict`'s, or one process's, saved in
    any layout) into ``model`` as it trains: plain, sharded, split over tensor ranks, or both.

    ``set_model_state_dict`` with full state dicts; a packed projection's rows are first put in the
    rank-major order its ranks hold them in (a key/value head copied over several ranks once per rank), so
    each rank takes its rows. Under a process group every rank calls it and rank 0's ``state`` is broadcast
    tensor by tensor (others may pass ``{}``).

    Args:
        model: the model, split, sharded or plain as it will train.
        state: the whole state dict, the plain model's keys.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from specvit.parallel_styles import held_order, packed_rows

    distributed = dist.is_available() and dist.is_initialized()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    with held_order():
        set_model_state_dict(model, _in_order(state, packed_rows(model), False), options=options)


def _in_order(tensors: dict[str, Any], rows: dict[str, Tensor], back: bool) -> dict[str, Any]:
    """``tensors`` by parameter name, those of packed projections put out of (``back``) or into rank-major order."""
    from specvit.parallel_styles import packed_order

    return {k: packed_order(v, rows[k], back) if k in rows else v for k, v in tensors.items()}


# ------------------------------------------------------------------------------------ memory per rank


@dataclass(frozen=True)
class MemoryEstimate:
    """Parameter counts of a model, split as :func:`shard` groups them, read from its graph.

    Attributes:
        name: the spec's name.
        params: all parameters (tied weights counted once).
        root_params: parameters outside the blocks (embeddings, positions, prefix, final norms, head):
            FSDP2's root group.
        block_params: parameters of the largest block.
    """

    name: str
    params: int
    root_params: int
    block_params: int

    def ddp_bytes(self) -> int:
        """Bytes per rank of fp32 parameters, gradients and AdamW states under DDP: all of it on every rank."""
        return ADAMW_BYTES_PER_PARAM * self.params

    def sharded_bytes(self, ranks: int) -> int:
        """Bytes per rank of fp32 parameters, gradients and AdamW states under FSDP2: a 1/ranks share.

        Args:
            ranks: the number of ranks sharded over.
        """
        return -(-ADAMW_BYTES_PER_PARAM * self.params // ranks)

    def gathered_bytes(self, bytes_per_param: int) -> int:
        """Bytes of parameters FSDP2 holds gathered at once: the root group, the running block and the next.

        Args:
            bytes_per_param: 4 when computing in fp32, 2 with a bf16 ``param_dtype``.
        """
        return bytes_per_param * (self.root_params + 2 * self.block_params)


def memory_estimate(spec: Spec) -> MemoryEstimate:
    """Parameter counts of ``spec``'s model from its graph (``build_graph(spec)``), nothing allocated.

    Args:
        spec: a validated spec.
    """
    from specvit.graph import build_graph

    graph = build_graph(spec)
    per_block: dict[str, int] = {}
    for _, a in graph.nx.nodes(data=True):
        if a["block"] is not None:
            per_block[a["block"]] = per_block.get(a["block"], 0) + int(a["params"])
    total = graph.total_params
    return MemoryEstimate(spec.name, total, total - sum(per_block.values()), max(per_block.values()))


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def memory_table(specs: Sequence[Spec], ranks: Sequence[int] = (1, 8, 64)) -> str:
    """A Markdown table of the training memory per rank of each spec's model, for 1, 8 and 64 ranks.

    Columns: DDP (fp32 parameters, gradients and AdamW states, 16 bytes per parameter, replicated);
    FSDP2 (the same 16 bytes per parameter, sharded over the ranks); and what FSDP2 gathers at once on
    top (the root group plus two blocks, in fp32 or as bf16 with a bf16 ``param_dtype``). Activations
    are not included. GB are 10^9 bytes.

    Args:
        specs: the specs to list.
        ranks: the world sizes to list.
    """
    lines = [
        "| model | parameters | ranks | DDP per rank | FSDP2 per rank, sharded | FSDP2 gathered, fp32 / bf16 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for spec in specs:
        m = memory_estimate(spec)
        for n in ranks:
            lines.append(
                f"| {m.name} | {m.params:,} | {n} | {_gb(m.ddp_bytes())} | {_gb(m.sharded_bytes(n))} | "
                f"{_gb(m.gathered_bytes(4))} / {_gb(m.gathered_bytes(2))} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ tensor parallel


def plan(model: SpecModel, mesh: DeviceMesh | int) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of ``model``, derived from its graph: see :func:`specvit.tensor_parallel.plan`.

    Args:
        model: a compiled model, not yet split.
        mesh: a 1-D device mesh, or the number of ranks.
    """
    from specvit.tensor_parallel import plan as derive

    return derive(model, mesh)


def parallelize(model: SpecModel, mesh: DeviceMesh | None = None) -> SpecModel:
    """Split ``model`` in place by :func:`plan` (``parallelize_module``): see
    :func:`specvit.tensor_parallel.parallelize`.

    Args:
        model: a compiled, materialised model with the same weights on every rank.
        mesh: a 1-D device mesh; default :func:`default_mesh`, every rank of the default process group.
    """
    from specvit.tensor_parallel import parallelize as split

    return split(model, mesh if mesh is not None else default_mesh())


# ------------------------------------------------------------------------------- optimizer states


def _reorder(state: dict[str, Any], rows: dict[str, Tensor], back: bool) -> dict[str, Any]:
    """``state``'s per-parameter tensors of packed projections, their rows put in or out of rank-major order."""
    from specvit.parallel_styles import packed_order

    out = {"param_groups": state["param_groups"], "state": dict(state["state"])}
    for name, order in rows.items():
        if name in out["state"]:
            out["state"][name] = {
                k: packed_order(v, order, back) if isinstance(v, Tensor) else v
                for k, v in out["state"][name].items()
            }
    return out


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name, as one process holds it, on rank 0's CPU.

    ``get_optimizer_state_dict`` with full state dicts, and a tensor-parallel packed projection's states
    (AdamW's moments) put back from the rank-major order its ranks keep into one process's packed order, as
    ``state_dict`` does for the weights: the dict loads into any layout (:func:`load_optimizer_state_dict`).
    A collective under a process group: every rank calls it; other ranks get empty states.

    Args:
        model: the model as trained (split, sharded or plain).
        optimizer: its optimizer.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = dict(get_optimizer_state_dict(model, optimizer, options=options))
    if not state.get("state"):
        return state
    from specvit.parallel_styles import packed_rows

    return _reorder(state, packed_rows(model), back=True)


def load_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a state of :func:`optimizer_state_dict` (saved in any layout) into ``optimizer``.

    Under a process group every rank calls it and rank 0's ``state`` is broadcast (others may pass ``{}``).

    Args:
        model: the model, split, sharded or plain as it will train.
        optimizer: its optimizer.
        state: the whole state, parameter names as keys.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    if state.get("state"):
        from specvit.parallel_styles import packed_rows

        state = _reorder(state, packed_rows(model), back=False)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_optimizer_state_dict(model, optimizer, state, options=options)
