"""Train a spec's model from the command line, on one process or on many under torchrun.

    python examples/train.py specs/mnist_vit.yaml --steps 200
    torchrun --standalone --nproc_per_node 2 examples/train.py specs/mnist_vit.yaml --parallel fsdp
    torchrun --standalone --nproc_per_node 2 examples/train.py specs/mnist_vit.yaml --tp 2
    torchrun --standalone --nproc_per_node 4 examples/train.py specs/mnist_vit.yaml --tp 2 --parallel fsdp
    torchrun --standalone --nproc_per_node 2 examples/train.py specs/mnist_vit.yaml --pp 2 --microbatches 4
    torchrun --standalone --nproc_per_node 4 examples/train.py specs/mnist_vit.yaml --pp 2 --tp 2
    torchrun --standalone --nproc_per_node 8 examples/train.py specs/mnist_vit.yaml --pp 2 --tp 2 --parallel fsdp

The data is synthetic unless ``--data`` names a safetensors file, and every batch is drawn from
(seed, step) alone, so a run resumed with ``--resume DIR`` sees the batches the uninterrupted run would
have seen, and dropout draws from (seed, step, rank): the resumed run continues the same loss curve.
The global batch is the same for any number of ranks; each rank takes its slice of it (with ``--tp N``,
tensor parallelism, every rank takes the whole batch and computes 1/N of every layer; with ``--pp M``,
pipeline parallelism, M ranks each run a stage of the blocks on ``--microbatches`` slices of the batch).

Synthetic tasks, by model:

- classifier on images: noise images with one bright patch; the class is that patch's index.
- classifier on tokens: random tokens; the class is the first token modulo the classes.
- token-level heads (LMs) on features, and classifiers on features: random vectors; the target is the
  index of the largest of the first K channels (K = the number of classes).
- decoder-only LM on tokens: sequences counting up by a step of 1 to 3 (modulo the vocabulary); the
  targets are the inputs shifted by one (next token).
- encoder-only LM head on tokens: the target is the input sequence reversed.
- encoder-decoder on tokens: the reverse task: ``tgt_out`` is ``src`` reversed, ``tgt_in`` is
  ``tgt_out`` shifted right behind a BOS token (id 1); tokens are drawn from 2 upwards.

A ``--data`` file holds ``inputs`` (N, ...) and integer ``targets`` (N,) or (N, S) for an encoder or
decoder, and ``src``, ``tgt_in`` (N, T) and integer ``tgt_out`` (N, T) for an encoder-decoder; each
epoch visits the N samples in an order drawn from (seed, epoch). The loss is the cross-entropy.

``--save DIR`` writes ``spec.yaml``, ``model.safetensors`` and ``checkpoint.json`` (``specvit.load_pretrained(DIR)`` reads
them) and ``trainer.safetensors``: the AdamW state of every parameter (``{parameter}/{state}``
tensors), with the step, seed, batch and parameter groups in its metadata. Under torchrun rank 0
writes both files from full state dicts gathered from every rank, and on ``--resume`` reads them and
sends every rank its part. The files hold the weights and moments as one process holds them, whatever the
layout (a tensor-parallel packed projection's rows put back from the rank-major order its ranks keep, a
copied key/value head once), so a checkpoint saved in any layout (``--parallel``, ``--tp``, ``--pp`` and
their combinations, on any number of ranks) resumes in any other, continuing the same loss curve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from specvit.checkpoint import SPEC_FILE, WEIGHTS_FILE, CheckpointError
from specvit.cli import EXIT_IO_ERROR, EXIT_SPEC_ERROR
from specvit.errors import SpecError, SpecFileError
from specvit.model import SpecModel, logits_of

if TYPE_CHECKING:
    from specvit.pipeline import Pipeline
from specvit.spec.schema import ClassifierHead, FeaturesInput, ImageInput, LMHead, Spec, TokensInput

TRAINER_FILE = "trainer.safetensors"
TRAINER_FORMAT = "specvit-trainer-1"
BOS, FIRST = 1, 2  # encoder-decoder task: the decoder's start token, the smallest content token
ENCODER_DECODER_KEYS = ("src", "tgt_in", "tgt_out")
MODEL_KEYS = ("inputs", "targets")


class TrainError(Exception):
    """A run that cannot start: bad arguments, data or checkpoint. Printed without a traceback."""


def mix(*parts: int) -> int:
    """One 63-bit seed from several integers (seed, purpose, step, rank), the same on every machine."""
    h = 0
    for p in parts:
        h = (h * 1_000_003 + p + 1) % (1 << 63)
    return h


# ------------------------------------------------------------------------------------------------ data


def _seq_limit(spec: Spec, role: str) -> int | None:
    """The longest token or feature sequence the stack's learned positions cover, or None for no limit."""
    stack = spec.stacks[role]
    pos = stack.position
    if pos.kind != "learned" or pos.max_len is None or stack.num_tokens is not None:
        return None
    return pos.max_len - (stack.num_prefix if pos.include_prefix else 0)


def _argmax_target(x: Tensor, k: int) -> Tensor:
    """The index of the largest of the first k channels of each vector: (..., Df) -> (...)."""
    return x[..., :k].argmax(-1)


def _stack_input(spec: Spec, role: str, n: int, length: int, gen: torch.Generator) -> Tensor:
    """Random inputs of a stack: images (n, C, H, W), tokens (n, length) or features (n, length, Df)."""
    inp = spec.stacks[role].input
    if isinstance(inp, ImageInput):
        return 0.5 * torch.randn(n, inp.channels, *inp.size, generator=gen)
    if isinstance(inp, TokensInput):
        return torch.randint(0, inp.vocab, (n, length), generator=gen)
    return torch.randn(n, length, inp.dim, generator=gen)


def synthetic_batch(spec: Spec, n: int, length: int, gen: torch.Generator) -> dict[str, Tensor]:
    """A batch of the spec's synthetic task (see the module docstring).

    Args:
        spec: the model's spec.
        n: samples.
        length: tokens per sequence for token and feature inputs.
        gen: the random generator, seeded from (seed, step).

    Raises:
        TrainError: for a model without a head, or an encoder-decoder whose inputs are not tokens.
    """
    head = spec.head
    role = spec.output_stack
    inp = spec.stacks[role].input
    if not isinstance(head, ClassifierHead | LMHead) or getattr(head, "classes", 0) is None:
        raise TrainError(f"{spec.name} has no head: there is no loss to train (add a classifier or lm head)")
    classes = head.classes if isinstance(head, ClassifierHead) else head.vocab or _vocab(spec, role)
    if spec.model == "encoder_decoder":
        enc, dec = spec.stacks["encoder"].input, inp
        if not isinstance(enc, TokensInput) or not isinstance(dec, TokensInput):
            raise TrainError(f"{spec.name}: the synthetic reverse task needs token inputs; pass --data FILE")
        vocab = min(enc.vocab, dec.vocab, classes)
        if vocab <= FIRST:
            raise TrainError(f"{spec.name}: the reverse task needs a vocabulary of at least {FIRST + 1}")
        src = torch.randint(FIRST, vocab, (n, length), generator=gen)
        tgt = src.flip(1)
        tgt_in = torch.cat((torch.full((n, 1), BOS), tgt[:, :-1]), dim=1)
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt}
    if isinstance(head, ClassifierHead):
        if isinstance(inp, ImageInput):
            (gh, gw), (ph, pw) = inp.grid, inp.patch
            labels = torch.randint(0, min(classes, gh * gw), (n,), generator=gen)
            bright = F.one_hot(labels, gh * gw).view(n, 1, gh, gw).float()
            bright = bright.repeat_interleave(ph, 2).repeat_interleave(pw, 3)  # (n, 1, H, W)
            return {"inputs": _stack_input(spec, role, n, length, gen) + 2.0 * bright, "targets": labels}
        x = _stack_input(spec, role, n, length, gen)
        if isinstance(inp, TokensInput):
            return {"inputs": x, "targets": x[:, 0] % classes}
        return {"inputs": x, "targets": _argmax_target(x[:, 0], classes)}
    if isinstance(inp, FeaturesInput):
        x = _stack_input(spec, role, n, length, gen)
        return {"inputs": x, "targets": _argmax_target(x, classes)}
    if not isinstance(inp, TokensInput):
        raise TrainError(f"{spec.name}: no synthetic task for an LM head on images; pass --data FILE")
    vocab = min(inp.vocab, classes)
    if spec.model == "encoder":
        x = torch.randint(0, vocab, (n, length), generator=gen)
        return {"inputs": x, "targets": x.flip(1)}
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    seq = (start + stride * torch.arange(length + 1)) % vocab  # (n, length + 1)
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:]}


def _vocab(spec: Spec, role: str) -> int:
    inp = spec.stacks[role].input
    if not isinstance(inp, TokensInput):
        raise TrainError(f"{spec.name}: an lm head on a non-token input needs head.vocab")
    return inp.vocab


class Batches:
    """The global batch of every step, drawn from (seed, step) only.

    Args:
        spec: the model's spec.
        batch: the global batch size.
        seed: the run's seed.
        length: tokens per sequence of synthetic token and feature inputs.
        data: tensors of a ``--data`` file, or None for the synthetic task.
    """

    def __init__(self, spec: Spec, batch: int, seed: int, length: int, data: dict[str, Tensor] | None):
        self.spec, self.batch, self.seed, self.length, self.data = spec, batch, seed, length, data
        self.size = next(iter(data.values())).shape[0] if data else 0

    def __call__(self, step: int) -> dict[str, Tensor]:
        """The global batch of step ``step`` (0-based)."""
        if self.data is None:
            gen = torch.Generator().manual_seed(mix(self.seed, 0, step))
            return synthetic_batch(self.spec, self.batch, self.length, gen)
        index: list[Tensor] = []
        pos, taken = step * self.batch, 0
        while taken < self.batch:
            epoch, offset = divmod(pos, self.size)
            order = torch.randperm(
                self.size, generator=torch.Generator().manual_seed(mix(self.seed, 2, epoch))
            )
            part = order[offset : offset + self.batch - taken]
            index.append(part)
            pos, taken = pos + len(part), taken + len(part)
        chosen = torch.cat(index)
        return {k: v[chosen] for k, v in self.data.items()}


def load_data(path: str, spec: Spec) -> dict[str, Tensor]:
    """The tensors of a ``--data`` file, checked against the model kind.

    Raises:
        TrainError: for missing keys, unequal sample counts or non-integer targets.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        data = load_file(path)
    except (SafetensorError, ValueError) as exc:
        raise TrainError(f"{path}: not a safetensors file ({exc})") from None
    keys = ENCODER_DECODER_KEYS if spec.model == "encoder_decoder" else MODEL_KEYS
    missing = [k for k in keys if k not in data]
    if missing:
        raise TrainError(
            f"{path}: missing tensors {missing} (a model of kind {spec.model} needs {list(keys)})"
        )
    data = {k: data[k] for k in keys}
    sizes = {k: v.shape[0] if v.ndim else 0 for k, v in data.items()}
    if len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise TrainError(f"{path}: every tensor needs the same, non-zero number of samples; got {sizes}")
    if data[keys[-1]].is_floating_point():
        raise TrainError(f"{path}: '{keys[-1]}' must hold integer class or token ids")
    return data


# ------------------------------------------------------------------------------------------- training


def inputs_and_target(spec: Spec, batch: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
    """The model's inputs in a batch, and the target of its outputs."""
    if spec.model == "encoder_decoder":
        return (batch["src"], batch["tgt_in"]), batch["tgt_out"]
    return (batch["inputs"],), batch["targets"]


def criterion(out: Tensor | dict[str, Tensor], targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits (B, C) or (B, S, V) against their targets."""
    return F.cross_entropy(logits_of(out).flatten(0, -2).float(), targets.flatten())


def loss_of(net: nn.Module, spec: Spec, batch: dict[str, Tensor]) -> Tensor:
    """Mean cross-entropy of the model on a batch."""
    inputs, targets = inputs_and_target(spec, batch)
    return criterion(net(*inputs), targets)


class Progress:
    """Loss reports on rank 0: a bar redrawn with ``\\r`` on a terminal, a line every ``every`` steps.

    Args:
        total: the last step.
        every: report every this many steps (and the last).
        stream: where to write.
        quiet: no redrawn bar even on a terminal (``--quiet``).
        log: a JSON-lines file that gets ``{"step": ..., "loss": ...}`` per report, or None.
    """

    def __init__(self, total: int, every: int, stream: TextIO, log: TextIO | None, quiet: bool = False):
        self.total, self.every, self.stream, self.log = total, every, stream, log
        self.tty = stream.isatty() and not quiet  # the redrawn bar; report lines are printed either way
        self.start = time.perf_counter()
        self.done = 0

    def update(self, step: int, loss: float) -> None:
        """Report the loss of step ``step`` (1-based)."""
        self.done += 1
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        left = round((self.total - step) / rate) if rate > 0 else 0
        eta = f"ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}" if step < self.total else "done"
        text = f"step {step}/{self.total}  loss {loss:.6f}  {rate:.2f} steps/s  {eta}"
        if step % self.every == 0 or step == self.total:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            if self.log is not None:
                self.log.write(json.dumps({"step": step, "loss": loss}) + "\n")
                self.log.flush()
        elif self.tty:
            width = 30
            filled = width * step // self.total
            self.stream.write(f"\r\033[K[{'#' * filled}{'.' * (width - filled)}] {text}")
        self.stream.flush()


# ----------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    directory: Path,
    model: SpecModel,
    opt: torch.optim.Optimizer,
    step: int,
    args: argparse.Namespace,
    pipe: Pipeline | None = None,
) -> None:
    """Write the model and the optimizer state; a collective: every rank calls it, rank 0 writes."""
    from safetensors.torch import save

    from specvit.io import atomic_write
    from specvit.parallel import full_state_dict, optimizer_state_dict

    if pipe is not None:  # each stage's weights and states, gathered
        weights, optim = pipe.full_state(opt)
    else:
        weights = full_state_dict(model)
        optim = optimizer_state_dict(model, opt)  # one process's order whatever the layout
    if _rank() == 0:
        model.save_pretrained(directory, overwrite=True, state_dict=weights)
        tensors = {
            f"{name}/{key}": value.detach().cpu().contiguous()
            for name, state in optim["state"].items()
            for key, value in state.items()
        }
        meta = {
            "format": TRAINER_FORMAT,
            "step": str(step),
            "seed": str(args.seed),
            "batch": str(args.batch),
            "param_groups": json.dumps(optim["param_groups"]),
        }
        atomic_write(directory / TRAINER_FILE, save(tensors, metadata=meta))
    if dist.is_initialized():
        dist.barrier()


def _read_checkpoint(
    directory: Path, spec: Spec, args: argparse.Namespace
) -> tuple[dict[str, Tensor], dict[str, Any], int]:
    """Rank 0's half of a resume: the weights, the optimizer state dict and the step, checked."""
    from safetensors import SafetensorError, safe_open

    from specvit.spec import load_spec

    for name in (SPEC_FILE, WEIGHTS_FILE, TRAINER_FILE):
        if not (directory / name).is_file():
            raise TrainError(f"--resume {directory}: {name} is missing (not a checkpoint of this script)")
    if load_spec(directory / SPEC_FILE) != spec:
        raise TrainError(f"--resume {directory}: its {SPEC_FILE} is not the spec being trained")
    try:
        with safe_open(directory / TRAINER_FILE, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        with safe_open(directory / WEIGHTS_FILE, framework="pt") as f:
            weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}: a checkpoint file is truncated or corrupted ({exc})") from None
    if meta.get("format") != TRAINER_FORMAT:
        raise TrainError(f"--resume {directory}: {TRAINER_FILE} is not a {TRAINER_FORMAT} file")
    for key in ("seed", "batch"):
        if int(meta[key]) != getattr(args, key):
            raise TrainError(
                f"--resume {directory}: the checkpoint was trained with --{key} {meta[key]}, "
                f"not {getattr(args, key)}; the same loss curve needs the same value"
            )
    state: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        name, _, part = key.rpartition("/")
        state.setdefault(name, {})[part] = value
    groups = json.loads(meta["param_groups"])
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return weights, {"state": state, "param_groups": groups}, int(meta["step"])


def resume(
    directory: Path,
    model: SpecModel,
    opt: torch.optim.Optimizer,
    spec: Spec,
    args: argparse.Namespace,
    pipe: Pipeline | None = None,
) -> int:
    """Load a checkpoint of :func:`save_checkpoint` into every rank; returns the step it was saved at."""
    from specvit.parallel import load_full_state_dict, load_optimizer_state_dict

    weights: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    step = 0
    if _rank() == 0:
        weights, optim, step = _read_checkpoint(directory, spec, args)
    if pipe is not None:  # each rank loads its stages' weights and optimizer states
        box: list[Any] = [weights, optim, step]
        dist.broadcast_object_list(box, src=0)
        pipe.load_state(box[0], opt, box[1])
        return int(box[2])
    distributed = dist.is_initialized()
    if distributed:
        box = [step]
        dist.broadcast_object_list(box, src=0)
        step = int(box[0])
    load_full_state_dict(model, weights)
    load_optimizer_state_dict(model, opt, optim)
    return step


# -------------------------------------------------------------------------------------------------- main


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a spec's model with AdamW on synthetic data (or --data), on one process or "
        "under torchrun with DDP or FSDP2. Exit status: 0 ok, 1 file error, 2 invalid spec or arguments.",
    )
    p.add_argument("spec", metavar="SPEC", help="spec file (.yaml)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], help="override a spec key")
    p.add_argument("--steps", type=int, default=100, help="train up to this step (a resumed run too)")
    p.add_argument("--batch", type=int, default=32, help="global batch, split over the ranks (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the batches and dropout")
    p.add_argument("--seq-len", type=int, default=16, help="length of synthetic token/feature sequences")
    p.add_argument(
        "--parallel",
        choices=["none", "ddp", "fsdp"],
        default="none",
        help="none: one process; ddp: DistributedDataParallel; fsdp: FSDP2 (specvit.parallel.shard)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="split every layer over N ranks, N processes under torchrun (specvit.parallel.parallelize)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="M",
        help="cut the blocks into M pipeline stages on M ranks (specvit.pipeline.Pipeline); with --tp N, "
        "M x N processes",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        metavar="K",
        help="slices of the batch a pipeline runs (default: 2 per stage)",
    )
    p.add_argument(
        "--schedule",
        choices=["1f1b", "gpipe", "interleaved"],
        default="1f1b",
        help="the pipeline's schedule; interleaved puts two stages on each rank (default 1f1b)",
    )
    p.add_argument("--checkpointing", action="store_true", help="recompute block activations in backward")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="compute in bfloat16: autocast (none, ddp) or an FSDP2 MixedPrecisionPolicy (fsdp)",
    )
    p.add_argument("--data", metavar="FILE", help="a safetensors file of training data (see the docstring)")
    p.add_argument("--save", metavar="DIR", help="write the model and optimizer state here at the end")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint written by --save")
    p.add_argument(
        "--log",
        "--log-file",
        dest="log",
        metavar="FILE",
        help="write {step, loss} JSON lines; a resumed run appends (under torchrun write --log-file: "
        "torchrun reads --log as an abbreviation of its own --log-dir)",
    )
    p.add_argument("--every", type=int, default=10, metavar="K", help="report every K steps (default 10)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar between reports on a terminal")
    p.add_argument(
        "--memory",
        action="store_true",
        help="print each rank's peak resident memory in training, above its resident memory before the build "
        "(Linux), to set against specvit summary --tp/--pp/--dp",
    )
    return p


def _setup(parallel: str, tp: int = 1, pp: int = 1) -> tuple[torch.device, bool]:
    """This rank's device, starting the process group when one is needed and none is running.

    Returns:
        The device, and whether this call started the group (and so should end it).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    split = tp * pp
    if split > 1 and (world % split if parallel == "fsdp" else split != world):
        more = f"a multiple of {split} (data x tensor ranks)" if parallel == "fsdp" else str(split)
        what = " ".join(f"--{k} {v}" for k, v in (("tp", tp), ("pp", pp)) if v > 1)
        raise TrainError(
            f"{what} splits over {split} processes, {world} were started: torchrun --nproc_per_node {more}"
        )
    if parallel == "none" and split == 1:
        if world > 1:
            raise TrainError(
                f"{world} processes were started: pass --parallel ddp, --parallel fsdp or --tp {world}"
            )
        return device, False
    if dist.is_initialized():  # a caller's group (a script that runs train() several times)
        return device, False
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
    else:  # one process without torchrun: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device, True


def train(args: argparse.Namespace) -> None:
    """Check the arguments, build, (re)load, train and save as they say.

    Under torchrun, ``--parallel ddp|fsdp`` starts the process group and ends it after the run, unless
    the caller has started one (then that group is used and left running).

    Raises:
        SpecError: for an invalid spec or ``--set``.
        TrainError: for arguments, data or a checkpoint that do not fit the spec.
    """
    from specvit.spec import load_spec, parse_overrides

    spec = load_spec(args.spec, overrides=parse_overrides(args.set))
    for flag in ("steps", "batch", "every", "seq_len"):
        if getattr(args, flag) < 1:
            raise TrainError(f"--{flag.replace('_', '-')} must be at least 1")
    roles = ["encoder", "decoder"] if spec.model == "encoder_decoder" else [spec.output_stack]
    for role in roles:
        limit = _seq_limit(spec, role)
        if args.data is None and limit is not None and args.seq_len > limit:
            raise TrainError(
                f"--seq-len {args.seq_len} is longer than the {role}'s {limit} learned positions"
            )
    save = Path(args.save) if args.save else None
    if save is not None and save.is_dir() and any(save.iterdir()) and not (save / SPEC_FILE).is_file():
        raise TrainError(f"--save {save}: the directory is not empty and holds no checkpoint")
    data = load_data(args.data, spec) if args.data else None
    if data is None:
        synthetic_batch(spec, 1, args.seq_len, torch.Generator())  # refuse a model without a task now
    _check_layout(args)
    device, started = _setup(args.parallel, args.tp, args.pp)
    try:
        _train(args, spec, data, save, device)
    finally:
        if started:
            dist.destroy_process_group()


def _check_layout(args: argparse.Namespace) -> None:
    """Refuse what tensor and pipeline parallelism do not combine with."""
    for flag in ("tp", "pp", "microbatches"):
        if (getattr(args, flag) or 1) < 1:
            raise TrainError(f"--{flag} must be at least 1")
    if args.pp > 1 and args.parallel == "ddp":
        raise TrainError("--pp with --parallel ddp is not supported: --parallel fsdp shards the data ranks")
    for kind in ("tp", "pp"):
        if getattr(args, kind) == 1:
            continue
        if kind == "tp" and args.parallel == "ddp":
            raise TrainError(
                "--tp with --parallel ddp is not supported: --parallel fsdp shards the data ranks"
            )
        for flag in ("bf16", "checkpointing"):
            if getattr(args, flag):
                raise TrainError(f"--{flag} with --{kind} is not supported")


def _build(
    args: argparse.Namespace, spec: Spec, device: torch.device, mesh: Any
) -> tuple[SpecModel, nn.Module, Pipeline | None]:
    """The model, the module the loop calls (split, sharded or wrapped), and this rank's pipeline stages."""
    from specvit.compile import build_model

    torch.manual_seed(args.seed)
    net: nn.Module
    pipe = None
    if mesh is not None:  # the same weights on every rank, split over the tensor ranks, then sharded or cut
        from specvit.parallel import parallelize, shard

        # a pipeline alone materialises only its stages' weights; a tensor-parallel split needs them all
        model = build_model(spec, device="meta" if args.tp == 1 and args.pp > 1 else device)
        net = parallelize(model, mesh["tp"]) if args.tp > 1 else model
        if args.parallel == "fsdp" and args.pp == 1:  # a pipeline shards its stages
            shard(model, mesh["dp"])
        if args.pp > 1:
            from specvit.pipeline import Pipeline

            pipe = Pipeline(
                model,
                criterion,
                microbatches=args.microbatches or 2 * args.pp,
                schedule=args.schedule,
                stages_per_rank=2 if args.schedule == "interleaved" else 1,
                inputs=("src", "tgt") if spec.model == "encoder_decoder" else None,
                group=mesh["pp"].get_group(),
                device=device,
                data=mesh["dp"] if args.parallel == "fsdp" else None,
            )
    elif args.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from specvit.parallel import shard

        model = build_model(spec, device="meta", checkpointing=args.checkpointing)
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if args.bf16
            else None
        )
        net = shard(model, mp_policy=policy)
        model.to_empty(device=device)
        model.init_weights()
    else:
        model = build_model(spec, device=device, checkpointing=args.checkpointing)
        net = model
        if args.parallel == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            net = nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    model.train()
    return model, net, pipe


def _mode(args: argparse.Namespace, world: int) -> str:
    """How the run is laid out, for its first line."""
    parts = [f"tensor parallel on {args.tp} ranks"] if args.tp > 1 else []
    if args.pp > 1:
        micro = args.microbatches or 2 * args.pp
        parts.append(f"pipeline on {args.pp} ranks ({args.schedule}, {micro} microbatches)")
    if parts and args.parallel == "fsdp":
        parts.append(f"fsdp on {world}")
    return " x ".join(parts) or f"{args.parallel} on {world} rank(s)"


def _status_mb(field: str) -> float:
    """A field of /proc/self/status in MiB (``VmRSS``: resident now, ``VmHWM``: the peak); 0 off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _report_memory(peak: float) -> None:
    """Print on rank 0 every rank's peak resident memory in training above its memory before the build (its
    weights, their gradients and optimizer states, activations, the collectives' buffers): ``--memory``."""
    peaks = [peak]
    if dist.is_initialized():
        peaks = [0.0] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
    if _rank() == 0:
        print("peak memory above start, MiB per rank: " + ", ".join(f"{p:.0f}" for p in peaks), flush=True)


def _train(
    args: argparse.Namespace,
    spec: Spec,
    data: dict[str, Tensor] | None,
    save: Path | None,
    device: torch.device,
) -> None:
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    group = mesh = None  # the data ranks' group, over which the loss is averaged
    if (
        args.tp * args.pp > 1
    ):  # a (data, pipeline, tensor) mesh: a data rank's others take the same batch slice
        from torch.distributed.device_mesh import init_device_mesh

        shape = (world // (args.tp * args.pp), args.pp, args.tp)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "pp", "tp"))
        world, rank, group = mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    if args.batch % world:
        raise TrainError(f"--batch {args.batch} does not split over {world} ranks")
    micro = args.microbatches or 2 * args.pp
    if args.pp > 1 and (args.batch // world) % micro:
        raise TrainError(
            f"--batch {args.batch} over {world} data rank(s) does not split into {micro} microbatches"
        )
    start_rss = _status_mb("VmRSS")
    model, net, pipe = _build(args, spec, device, mesh)
    opt = torch.optim.AdamW(pipe.parameters() if pipe else net.parameters(), lr=args.lr)
    start = resume(Path(args.resume), model, opt, spec, args, pipe) if args.resume else 0
    if args.memory:  # the peak from here on: a tensor-parallel split's whole-model build is not counted
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    autocast = args.bf16 and args.parallel != "fsdp"
    batches = Batches(spec, args.batch, args.seed, args.seq_len, data)
    per = args.batch // world
    params = sum(p.numel() for p in model.parameters())  # a sharded DTensor counts its whole size
    log = None
    if _rank() == 0:
        print(
            f"{spec.name}: {params:,} parameters, {_mode(args, world)} ({device.type}), "
            f"batch {args.batch} ({per} per rank), steps {start + 1}..{args.steps}",
            flush=True,
        )
        if args.log:
            log = open(args.log, "a" if args.resume else "w")  # noqa: SIM115 (closed below)
    progress = Progress(args.steps, args.every, sys.stdout, log, args.quiet) if _rank() == 0 else None
    try:
        for step in range(start, args.steps):
            torch.manual_seed(mix(args.seed, 1, step, rank))  # dropout, the same after a resume
            batch = {k: v[rank * per : (rank + 1) * per].to(device) for k, v in batches(step).items()}
            opt.zero_grad(set_to_none=True)
            if pipe is not None:
                inputs, target = inputs_and_target(spec, batch)
                value = torch.tensor(pipe.step(*inputs, target=target))
            else:
                with (
                    torch.autocast(device.type, dtype=torch.bfloat16)
                    if autocast
                    else contextlib.nullcontext()
                ):
                    loss = loss_of(net, spec, batch)
                loss.backward()
                value = loss.detach().float().clone()
            opt.step()
            if world > 1:
                dist.all_reduce(value, group=group)
                value /= world
            if progress is not None:
                progress.update(step + 1, value.item())
        if args.memory:
            _report_memory(_status_mb("VmHWM") - start_rss)
        if save is not None:
            save_checkpoint(save, model, opt, max(start, args.steps), args, pipe)
            if _rank() == 0:
                print(f"saved {save}")
    finally:
        if log is not None:
            log.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        train(args)
        return 0
    except (SpecError, TrainError) as exc:
        print(f"train.py: {exc}" if isinstance(exc, TrainError) else exc, file=sys.stderr)
        return EXIT_IO_ERROR if isinstance(exc, SpecFileError) else EXIT_SPEC_ERROR
    except CheckpointError as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        return EXIT_IO_ERROR
    except OSError as exc:
        print(f"train.py: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_IO_ERROR


def exit_process(status: int) -> None:
    """End this process with ``status``; a rank of a distributed run ends without interpreter teardown.

    Under DDP and FSDP2 on gloo, the process group's C++ threads (``pt_gloo_runloop``, ``gloo_tcp_loop``)
    outlive ``destroy_process_group()`` and ``gc.collect()``: something in C++ still holds the group, which
    is destroyed only when the interpreter and then the C++ statics are torn down at exit. A thread that
    still drops a tensor owning a Python object then needs the GIL after finalization began; Python ends
    such a thread with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls
    ``std::terminate`` ("terminate called without an active exception", SIGABRT) and torchrun reports a
    finished run as failed. Once the run is over (the group destroyed, files closed), the rank flushes its
    output and leaves with ``os._exit``: no teardown, no race, the status it computed.

    Args:
        status: the exit status.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    exit_process(main())
