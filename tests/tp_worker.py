"""The distributed half of tests/test_tensor_parallel.py, run by ``torchrun --nproc_per_node N`` on gloo.

Each spec of ``SPECS`` is built under the same seed on every rank, split by ``specvit.parallel.parallelize``
over the N ranks, and trained ``STEPS`` AdamW steps on whole batches (tensor parallelism: every rank sees
the batch, each computes its heads, hidden channels, experts and vocabulary rows). Rank 0 writes into OUT:

- ``results.json``: the loss of each step per spec, the local head counts and shards seen on a rank, and
  whether ``full_state_dict`` of the split model before training equals the model it was split from
  (packed projections are stored rank-major and must come back in one process's order), and whether the
  untrained weights loaded back after training (``set_model_state_dict``, one process's order) gather to
  the same again;
- ``state_<spec>.safetensors``: the full state dict after training, gathered;
- ``train_tp.jsonl``: the losses of examples/train.py run with ``--tp N`` (and its exit status, and that of
  a run refused because 1 head does not split, in results.json).

The helpers (specs, batches, the loss) are imported by the test process for its one-process references.

Usage: torchrun --standalone --nproc_per_node N tests/tp_worker.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import dist_worker  # beside this file: the script's directory is first on sys.path
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import specvit
from specvit.model import SpecModel, logits_of

BATCH = 4
SEQ = 8
STEPS = 5
BACKEND = os.environ.get("SPECVIT_TEST_BACKEND", "gloo")
"""``nccl``: every rank on its CUDA GPU (tests/test_tensor_parallel.py runs it when GPUs are present)."""
DEVICE = (
    torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if BACKEND == "nccl" else torch.device("cpu")
)

VIT = """specvit: 1
name: tp_vit
model: encoder
encoder:
  input: {kind: image, size: 16, patch: 4, channels: 1}
  prefix: {cls: true}
  position: learned
  width: 32
  depth: 2
  block: {heads: 4, mlp: {ratio: 2}}
head: {kind: classifier, classes: 4}
"""

LM = """specvit: 1
name: tp_llama
model: decoder
decoder:
  input: {kind: tokens, vocab: 16}
  position: rope
  width: 64
  depth: 2
  block:
    heads: 8
    kv_heads: 4
    qk_norm: true
    layers: [masked_self_attention, mlp]
    norm: {kind: rmsnorm}
    mlp: {activation: swiglu, bias: false}
head: {kind: lm}
"""
"""A Llama-style decoder: GQA (8 query, 4 key/value heads), RoPE, QK-norm, RMSNorm, SwiGLU, untied head."""

ENCDEC = dist_worker.ENCDEC  # the encoder-decoder the FSDP/DDP runs train

MOE = """specvit: 1
name: tp_moe
model: decoder
decoder:
  input: {kind: tokens, vocab: 16}
  position: rope
  width: 32
  depth: 2
  block:
    heads: 4
    layers: [masked_self_attention, mlp]
    norm: {kind: rmsnorm}
    mlp:
      hidden: 32
      activation: swiglu
      bias: false
      moe: {experts: 4, top_k: 2, shared_hidden: 16, shared_gate: true}
head: {kind: lm, tied: true}
"""
"""A Qwen2-MoE-style decoder: 4 experts, 2 per token, a gated shared expert, tied head."""

TRAIN_ARGS = [
    str(Path(__file__).resolve().parents[1] / "specs" / "mnist_vit.yaml"),
    *("--set", "encoder.width=32", "--set", "encoder.block.mlp.hidden=64", "--set", "encoder.block.heads=4"),
    *("--batch", "8", "--every", "1", "--steps", "3"),
]
"""examples/train.py on a small MNIST ViT, run with ``--tp N`` by the worker and on one process by the test."""


load_train_script = dist_worker.load_train_script  # examples/train.py as a module


BERT = """specvit: 1
name: tp_bert
model: encoder
encoder:
  input: {kind: tokens, vocab: 20, padding_idx: 0, type_vocab: 2}
  position: {kind: learned, max_len: 16}
  width: 32
  depth: 2
  embed_norm: true
  block: {heads: 4, norm: {placement: post}}
head: {kind: lm}
"""
"""A BERT-like encoder: padding index, token types, post-norm, an untied LM head over its tokens."""

MQA = LM.replace("name: tp_llama", "name: tp_mqa").replace("kv_heads: 4", "kv_heads: 1")
"""The Llama decoder with one key/value head (MQA): copied to every rank, its copies' gradients summed."""

SPECS = {"vit": VIT, "bert": BERT, "llama": LM, "mqa": MQA, "encdec": ENCDEC, "moe": MOE}
ROUTER_LOSS = 0.02
"""The load-balancing loss's coefficient (Mixtral's), so that the router's gradient has both parts."""


def batch(spec: specvit.Spec, step: int) -> dict[str, Tensor]:
    """The batch of a step: images and labels, next tokens for decoders, the reverse task for token encoders
    and encoder-decoders."""
    gen = torch.Generator().manual_seed(step)
    inp = next(iter(spec.stacks.values())).input
    if inp.kind == "image":
        return {
            "x": torch.randn(BATCH, 1, 16, 16, generator=gen),
            "y": torch.randint(0, 4, (BATCH,), generator=gen),
        }
    if spec.model == "encoder":  # padding (id 0) among the tokens
        tokens = torch.randint(0, inp.vocab, (BATCH, SEQ), generator=gen)
        return {"x": tokens, "y": tokens.flip(1)}
    tokens = torch.randint(2, inp.vocab, (BATCH, SEQ + 1), generator=gen)
    if spec.model == "decoder":
        return {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    src = tokens[:, :SEQ]
    tgt = src.flip(1)
    return {
        "src": src,
        "tgt_in": torch.cat((torch.ones(BATCH, 1, dtype=torch.long), tgt[:, :-1]), 1),
        "y": tgt,
    }


def loss_of(model: nn.Module, spec: specvit.Spec, b: dict[str, Tensor]) -> Tensor:
    """Cross-entropy of the logits (plus the load-balancing loss of an MoE model)."""
    out = model(b["src"], b["tgt_in"]) if spec.model == "encoder_decoder" else model(b["x"])
    loss = F.cross_entropy(logits_of(out).flatten(0, -2), b["y"].flatten())
    return loss + ROUTER_LOSS * out["router_loss"] if isinstance(out, dict) else loss


def build(text: str) -> SpecModel:
    """The model of a spec under seed 0: the same weights on every rank and in the test process (drawn on
    the CPU, then moved to this rank's device)."""
    torch.manual_seed(0)
    return specvit.build_model(specvit.parse_spec(text)).to(DEVICE)


def train(model: nn.Module, spec: specvit.Spec, ranks: int = 1, group: Any = None) -> list[float]:
    """STEPS AdamW steps; the loss of each step. ``ranks`` data ranks each take their slice of the batch:
    with ``group`` (the data ranks' process group) this process is one of them and the loss is averaged over
    the group; without, this one process computes every slice's loss and averages them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    mine = [dist.get_group_rank(group, dist.get_rank())] if group is not None else range(ranks)
    for step in range(STEPS):
        whole, per = {k: v.to(DEVICE) for k, v in batch(spec, step).items()}, BATCH // ranks
        parts = [
            loss_of(model, spec, {k: v[r * per : (r + 1) * per] for k, v in whole.items()}) for r in mine
        ]
        loss = sum(parts) / len(parts)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if group is not None:
            dist.all_reduce(value, group=group)
            value /= ranks
        losses.append(value.item())
    return losses


def facts(model: nn.Module) -> dict[str, Any]:
    """What a rank holds: local head counts, local shapes of split parameters, their placements."""
    from torch.distributed.tensor import DTensor

    heads = {n: [m.num_heads, m.num_kv_heads] for n, m in model.named_modules() if hasattr(m, "num_kv_heads")}
    local = {
        n: [list(p.to_local().shape), str(p.placements[0])]
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    return {"heads": heads, "local": local}


def _unsummed(mesh: Any, what: str = "_summed", text: str = LM) -> list[float]:
    """The controls: the Llama decoder split without summing its QK-norm weights' gradients over the ranks
    (``_summed``), the MQA decoder without summing its key/value head's copies' (``_sum_copies``)."""
    from specvit import parallel_styles
    from specvit.parallel import parallelize

    summed = getattr(parallel_styles, what)
    setattr(parallel_styles, what, lambda grad, **_: grad)  # each rank keeps only its own heads' part
    try:
        model = parallelize(build(text), mesh)
    finally:
        setattr(parallel_styles, what, summed)
    return train(model, model.spec)


def main(out: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from specvit.parallel import full_state_dict, parallelize
    from specvit.parallel_layout import layout_report

    if BACKEND == "nccl":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(DEVICE.type, (world,))
    results: dict[str, Any] = {"world": world}
    for name, text in SPECS.items():
        model = build(text)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        parallelize(model, mesh)
        gathered = full_state_dict(model)
        if rank == 0:
            results[f"{name}/state_equal"] = gathered.keys() == before.keys() and all(
                torch.equal(gathered[k], before[k]) for k in before
            )
        results[f"{name}/facts"] = facts(model)
        results[f"{name}/local_params"] = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
        )
        results[f"{name}/predicted_params"] = layout_report(model.spec, tp=world).stages[0].params
        results[f"{name}/losses"] = train(model, model.spec)
        try:
            parallelize(model, mesh)
        except TypeError as exc:
            results[f"{name}/twice"] = str(exc)
        trained = full_state_dict(model)
        if rank == 0:
            save_file(
                {k: v.cpu().contiguous() for k, v in trained.items()}, out / f"state_{name}.safetensors"
            )
        load = {
            k: v.clone() for k, v in before.items()
        }  # set_model_state_dict replaces the values it is given
        set_model_state_dict(model, load, options=StateDictOptions(full_state_dict=True))  # packed order
        again = full_state_dict(model)
        if rank == 0:
            results[f"{name}/reloaded_equal"] = all(torch.equal(again[k], before[k]) for k in before)
    results["llama/unsummed/losses"] = _unsummed(mesh)
    results["mqa/uncopied/losses"] = _unsummed(mesh, "_sum_copies", MQA)
    script = load_train_script()
    results["train_tp_exit"] = script.main(
        [*TRAIN_ARGS, "--tp", str(world), "--log-file", str(out / "train_tp.jsonl")]
    )
    saved = [*TRAIN_ARGS, "--tp", str(world), "--save", str(out / "tp_checkpoint")]  # steps 1-3, split
    results["train_tp_save_exit"] = script.main(saved)
    one = os.environ.get("SPECVIT_ONE_PROCESS_CHECKPOINT")  # steps 1-3 on one process, resumed split
    if one:
        resumed = [*TRAIN_ARGS, "--tp", str(world), "--resume", one, "--steps", "5"]
        results["train_tp_resume_exit"] = script.main([*resumed, "--log-file", str(out / "tp_resumed.jsonl")])
    refused = [*TRAIN_ARGS, "--set", "encoder.block.heads=1", "--tp", str(world)]  # 1 head over N ranks
    results["train_tp_refused_exit"] = script.main(refused)
    if world == 4:  # TP inside FSDP2: 2 data ranks x 2 tensor ranks
        from specvit.parallel import shard

        grid = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
        for name, text in SPECS.items():
            model = parallelize(build(text), grid["tp"])
            shard(model, grid["dp"])
            results[f"{name}/2d/losses"] = train(model, model.spec, 2, grid["dp"].get_group())
        log = out / "train_2d.jsonl"
        results["train_2d_exit"] = script.main(
            [*TRAIN_ARGS, "--tp", "2", "--parallel", "fsdp", "--log-file", str(log)]
        )
    dist_worker.finish(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    dist_worker.leave()
