"""The distributed half of tests/test_distributed.py, run by ``torchrun --nproc_per_node 2`` on gloo.

One launch does every check that needs several processes (each launch pays seconds of start-up), and
rank 0 writes what the test process compares against single-process runs into OUT:

- ``results.json``: the loss per step of DDP and FSDP2 runs (with activation checkpointing, with bf16
  mixed precision), and facts about the sharded models;
- ``init_<spec>.safetensors``: the full weights of a meta-device build sharded, materialised and
  initialised on two ranks; ``outputs.safetensors``: model outputs on fixed inputs;
- ``timm_<name>/`` (written by the test process before the launch): converted timm models, trained
  under FSDP2 from their weights;
- ``ckpt/``: a checkpoint of a trained FSDP2 model (``full_state_dict`` + ``save_pretrained``);
- ``train_ddp/``, ``train_fsdp/``, ``train.jsonl``: examples/train.py run 3 steps under DDP, then
  resumed under FSDP2 with activation checkpointing up to step 6.

The helpers (specs, batches, the training loop) are imported by the test process for its references.

Usage: torchrun --standalone --nproc_per_node 2 tests/dist_worker.py OUT
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import specvit
from specvit.model import SpecModel

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 8
STEPS = 5
TINY_VIT = ["--set", "encoder.width=32", "--set", "encoder.block.mlp.hidden=64", "--batch", str(GLOBAL_BATCH)]
"""examples/train.py arguments: specs/mnist_vit.yaml made smaller, on the global batch of these tests."""

VIT = """specvit: 1
name: dist_vit
model: encoder
encoder:
  input: {kind: image, size: 16, patch: 4, channels: 1}
  prefix: {cls: true}
  position: learned
  width: 32
  depth: 2
  block: {heads: 2, mlp: {ratio: 2}}
head: {kind: classifier, classes: 4}
"""

ENCDEC = """specvit: 1
name: dist_reverser
model: encoder_decoder
encoder:
  input: {kind: tokens, vocab: 12}
  position: {kind: learned, max_len: 16}
  width: 32
  depth: 2
  block: {heads: 4, mlp: {ratio: 2}}
decoder:
  input: {kind: tokens, vocab: 12}
  position: {kind: learned, max_len: 16}
  width: 32
  depth: 2
  block: {heads: 4, layers: [masked_self_attention, cross_attention, mlp], mlp: {ratio: 2}}
shared_embeddings: true
head: {kind: lm, tied: true}
"""

LM = """specvit: 1
name: dist_lm
model: decoder
decoder:
  input: {kind: tokens, vocab: 16}
  position: rope
  width: 32
  depth: 2
  block:
    heads: 4
    kv_heads: 2
    qk_norm: true
    layers: [masked_self_attention, mlp]
    norm: {kind: rmsnorm}
    mlp: {activation: swiglu}
head: {kind: lm, tied: true}
"""

VIT_EXTRA = """specvit: 1
name: dist_vit_extra
model: encoder
encoder:
  input: {kind: image, size: 16, patch: 4, channels: 3}
  prefix: {cls: true, registers: 2}
  position: sincos2d
  width: 32
  depth: 2
  block: {heads: 2, layer_scale: 1.0e-5}
head: {kind: classifier, classes: 5, pool: mean, norm: true}
"""

BERT = """specvit: 1
name: dist_bert
model: encoder
encoder:
  input: {kind: tokens, vocab: 20, padding_idx: 0, type_vocab: 2}
  position: {kind: learned, max_len: 16}
  width: 32
  depth: 2
  embed_norm: true
  block: {heads: 2, norm: {placement: post}}
"""

SHARED = VIT.replace("dist_vit", "dist_shared").replace(
    "  depth: 2\n", "  depth: 4\n  share: {blocks: 2, order: cycle}\n"
)
"""A ViT whose two sets of block weights each run twice per forward."""

TRAINED = {"vit": VIT, "encdec": ENCDEC, "shared": SHARED}
"""Specs trained for STEPS steps on one process, under DDP and under FSDP2."""
INIT = {"vit": VIT, "encdec": ENCDEC, "lm": LM, "vit_extra": VIT_EXTRA, "bert": BERT}
"""Specs built on the meta device, sharded, materialised and initialised."""


def load_train_script() -> ModuleType:
    """examples/train.py as a module."""
    spec = importlib.util.spec_from_file_location("specvit_train_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(model: SpecModel, step: int) -> dict[str, Tensor]:
    """The global batch of a step: images and labels, or the reverse task's src, tgt_in and tgt_out."""
    gen = torch.Generator().manual_seed(step)
    if model.spec.model == "encoder_decoder":
        src = torch.randint(2, 12, (GLOBAL_BATCH, 8), generator=gen)
        tgt = src.flip(1)
        return {
            "src": src,
            "tgt_in": torch.cat((torch.ones(GLOBAL_BATCH, 1, dtype=torch.long), tgt[:, :-1]), 1),
            "tgt_out": tgt,
        }
    image, classes = model.spec.stacks["encoder"].input, model.spec.head.classes
    return {
        "x": torch.randn(GLOBAL_BATCH, image.channels, *image.size, generator=gen),
        "y": torch.randint(0, classes, (GLOBAL_BATCH,), generator=gen),
    }


def loss_and_logits(net: nn.Module, spec: specvit.Spec, b: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The cross-entropy of a batch (or of a rank's slice of it) and the logits."""
    if spec.model == "encoder_decoder":
        logits, target = net(b["src"], b["tgt_in"]), b["tgt_out"]
    else:
        logits, target = net(b["x"]), b["y"]
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten()), logits


def outputs_of(model: nn.Module, spec: specvit.Spec) -> dict[str, Tensor]:
    """The model's output and its output stack's features (B, N, D) on fixed inputs, in eval mode.

    The features matter where the output does not tell: a fresh ViT's zero classifier outputs zeros.
    """
    gen = torch.Generator().manual_seed(123)
    inputs = []
    for stack in spec.stacks.values():
        inp = stack.input
        if inp.kind == "image":
            inputs.append(torch.randn(2, inp.channels, *inp.size, generator=gen))
        else:
            assert inp.kind == "tokens"
            inputs.append(torch.randint(0, inp.vocab, (2, 8), generator=gen))
    seen: list[Tensor] = []
    hook = model.get_submodule(spec.output_stack).register_forward_hook(lambda m, i, o: seen.append(o))
    model.eval()
    with torch.no_grad():
        out = model(*inputs)
    hook.remove()
    return {"output": out, "features": seen[0].clone()}


def train(
    text: str | Path,
    mode: str,
    *,
    checkpointing: bool = False,
    mp: bool = False,
    reshard_after_forward: bool = True,
) -> tuple[list[float], SpecModel, dict[str, Any]]:
    """Train STEPS AdamW steps on the global batches; each rank takes its slice.

    Args:
        text: the spec, or the directory of a checkpoint to start from.
        mode: ``none`` (one process, whole batches), ``ddp`` or ``fsdp``.
        checkpointing: activation checkpointing per block.
        mp: FSDP2 mixed precision, bf16 compute and fp32 reduction.
        reshard_after_forward: FSDP2's choice for every group.

    Returns:
        The global loss of each step, the model, and facts about the run.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from specvit.parallel import shard

    world, rank = (dist.get_world_size(), dist.get_rank()) if mode != "none" else (1, 0)
    torch.manual_seed(0)
    if isinstance(text, Path):  # a converted model's weights, trained on
        model = specvit.load_pretrained(text).train()
    else:
        model = specvit.build_model(specvit.parse_spec(text), checkpointing=checkpointing)
    spec = model.spec
    net: nn.Module = model
    if mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
        shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    per = GLOBAL_BATCH // world
    losses: list[float] = []
    facts: dict[str, Any] = {}
    for step in range(STEPS):
        local = {k: v[rank * per : (rank + 1) * per] for k, v in batch(model, step).items()}
        loss, logits = loss_and_logits(net, spec, local)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in net.parameters()]
        facts["grads_finite"] = facts.get("grads_finite", True) and all(
            g is not None and bool(torch.isfinite(g).all()) for g in grads
        )
        facts["logits_dtype"] = str(logits.dtype)
        opt.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        losses.append(value.item() / world)
    facts["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return losses, model, facts


def main(out: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FSDPModule

    from specvit.parallel import full_state_dict, shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {"world": dist.get_world_size()}
    outputs: dict[str, Tensor] = {}

    for name, text in TRAINED.items():
        for mode in ("ddp", "fsdp"):
            results[f"{name}/{mode}"], model, _ = train(text, mode)
        spec = model.spec
        results[f"{name}/groups"] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
        outputs.update({f"trained/{name}/{k}": v for k, v in outputs_of(model, spec).items()})
        weights = full_state_dict(model)
        if rank == 0:
            model.save_pretrained(out / f"ckpt_{name}", state_dict=weights)
    for checkpoint in sorted(out.glob("timm_*")):  # converted timm models, written by the test process
        results[f"{checkpoint.name}/fsdp"], _, _ = train(checkpoint, "fsdp")
    results["vit/fsdp_checkpointing"], _, _ = train(VIT, "fsdp", checkpointing=True)
    results["encdec/fsdp_checkpointing_keep"], _, _ = train(
        ENCDEC, "fsdp", checkpointing=True, reshard_after_forward=False
    )
    results["vit/fsdp_bf16"], model, results["vit/fsdp_bf16_facts"] = train(VIT, "fsdp", mp=True)
    try:
        shard(model)
    except TypeError as exc:
        results["shard_twice"] = str(exc)
    ddp = nn.parallel.DistributedDataParallel(specvit.build_model(specvit.parse_spec(VIT)))
    results["ddp_state_keys"] = sorted(full_state_dict(ddp))

    for name, text in INIT.items():
        spec = specvit.parse_spec(text)
        torch.manual_seed(0)
        model = specvit.build_model(spec, device="meta")
        shard(model)
        model.to_empty(device="cpu")
        model.init_weights()
        results[f"init/{name}/buffers"] = len(list(model.buffers()))
        outputs.update({f"init/{name}/{k}": v for k, v in outputs_of(model, spec).items()})
        weights = full_state_dict(model)
        if rank == 0:
            save_file(weights, out / f"init_{name}.safetensors")

    script = load_train_script()
    common = [
        str(ROOT / "specs" / "mnist_vit.yaml"),
        *TINY_VIT,
        "--every",
        "1",
        "--log-file",
        str(out / "train.jsonl"),
    ]
    first = [*common, "--parallel", "ddp", "--steps", "3", "--save", str(out / "train_ddp")]
    results["train_ddp_exit"] = script.main(first)
    then = [
        *common,
        "--parallel",
        "fsdp",
        "--checkpointing",
        "--steps",
        "6",
        "--resume",
        str(out / "train_ddp"),
    ]
    results["train_fsdp_exit"] = script.main([*then, "--save", str(out / "train_fsdp")])

    if rank == 0:
        save_file({k: v.contiguous() for k, v in outputs.items()}, out / "outputs.safetensors")
    finish(out, results)


def finish(out: Path, results: dict[str, Any]) -> None:
    """Rank 0 writes ``results`` to OUT/results.json; every rank waits for it and ends the process group."""
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def leave() -> None:
    """End a worker whose results are written and group destroyed, without the interpreter's finalisation:
    on a loaded machine gloo's C++ worker threads can still hold work whose tensors reference Python objects,
    and freeing them during finalisation aborts the process ("terminate called without an active
    exception", SIGABRT; pytorch/pytorch#179291 describes it) after every result is already on disk."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave()
