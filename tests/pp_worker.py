"""The distributed half of tests/test_pipeline.py, run by ``torchrun --nproc_per_node N`` on gloo.

Each spec of ``SPECS`` (tests/tp_worker.py's, four blocks deep so that four stages have a block each) is
built under the same seed on every rank, cut into pipeline stages by ``specvit.pipeline.Pipeline`` and trained
``STEPS`` AdamW steps, in each layout of ``LAYOUTS[N]``: a schedule, the stages per rank, the microbatches,
and tensor-parallel ranks inside each stage. Rank 0 writes into OUT:

- ``results.json``: per layout and spec, the loss of each step; the control (the encoder-decoder whose
  shared embedding's gradients are not summed over the stages holding it); the exit statuses of
  examples/train.py runs;
- ``train_pp.jsonl``, ``pp_resumed.jsonl``: the losses of examples/train.py with ``--pp N``, and of its resume
  of a one-process checkpoint; ``pp_checkpoint``: a checkpoint it saved at ``--pp N``;
- on 4 ranks, for the decoders of ``CHECKPOINTED`` (their specs and one-process checkpoints of steps 1-3
  written into OUT by the test process): ``pptp_<spec>``, steps 1-3 saved at ``--pp 2 --tp 2``,
  ``pptp_resumed_<spec>.jsonl``, steps 4-5 resumed there from the one-process checkpoint,
  ``tp_fsdp_resumed_mqa.jsonl``, steps 4-5 of ``pptp_mqa`` resumed at ``--tp 2 --parallel fsdp``,
  ``tp_fsdp_mqa``, steps 1-3 saved at ``--tp 2 --parallel fsdp``, and ``pptp_control``: the control's checkpoint (AdamW's moments saved as the ranks hold them).

Usage: torchrun --standalone --nproc_per_node N tests/pp_worker.py OUT
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dist_worker  # beside this file: the script's directory is first on sys.path
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tp_worker
from torch import Tensor

import specvit
from specvit.model import logits_of
from specvit.pipeline import Pipeline

STEPS = tp_worker.STEPS
SPECS = {
    name: text if "encoder_decoder" in text else text.replace("depth: 2", "depth: 4")
    for name, text in tp_worker.SPECS.items()
}
"""Four blocks each (the encoder-decoder: two in each stack)."""

LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    2: {
        "1f1b": {"schedule": "1f1b", "microbatches": 2},
        "gpipe": {"schedule": "gpipe", "microbatches": 4},
        "interleaved": {"schedule": "interleaved", "microbatches": 4, "stages_per_rank": 2},
    },
    4: {
        "1f1b": {"schedule": "1f1b", "microbatches": 4},
        "pp2_tp2": {"schedule": "1f1b", "microbatches": 2, "tp": 2},
        "pp2_fsdp2": {"schedule": "1f1b", "microbatches": 2, "dp": 2},
    },
}
"""Per world size: the layouts run, by name."""

TRAIN_ARGS = [*tp_worker.TRAIN_ARGS, "--set", "encoder.depth=4"]
"""examples/train.py on a small MNIST ViT of four blocks."""

CHECKPOINTED = {
    "llama": ["--pp", "2", "--tp", "2"],
    "mqa": ["--pp", "2", "--tp", "2", "--parallel", "fsdp"],
}
"""The decoders whose checkpoints cross between one process and 2 stages x 2 tensor ranks, and that layout:
the Llama-style GQA decoder (packed q|k|v, 4 key/value heads split over the tensor ranks), and its MQA twin
(its one key/value head copied on both tensor ranks) with FSDP2 inside each stage (one data rank: each
stage's weights on a (data, tensor) mesh)."""


def lm_args(out: Path, name: str) -> list[str]:
    """examples/train.py on a decoder of ``SPECS``, 3 steps; its spec file is OUT/<name>.yaml."""
    return [str(out / f"{name}.yaml"), "--batch", "8", "--every", "1", "--steps", "3"]


@contextlib.contextmanager
def moments_as_held() -> Iterator[None]:
    """The control: a pipeline's checkpoint as before the fix: the weights put in one process's order by
    their ``state_dict`` hooks, AdamW's moments left in the rank-major order the tensor ranks hold them."""
    from specvit import parallel_styles

    held, rows = parallel_styles.held_order, Pipeline._rows
    parallel_styles.held_order = contextlib.nullcontext  # the hooks translate the weights
    Pipeline._rows = lambda self: {}  # and nothing the states
    try:
        yield
    finally:
        parallel_styles.held_order, Pipeline._rows = held, rows


def pp_tp_checkpoints(script: Any, out: Path) -> dict[str, int]:
    """examples/train.py at 2 stages x 2 tensor ranks: steps 1-3 saved, and steps 4-5 resumed from one
    process's steps 1-3, for each decoder of ``CHECKPOINTED``; the control's save. Their exit statuses."""
    exits = {}
    for name, layout in CHECKPOINTED.items():
        args = [*lm_args(out, name), *layout]
        exits[f"pptp_save_exit/{name}"] = script.main([*args, "--save", str(out / f"pptp_{name}")])
        log = ["--log-file", str(out / f"pptp_resumed_{name}.jsonl")]
        resumed = [*args, "--resume", str(out / f"one_{name}"), "--steps", "5", *log]
        exits[f"pptp_resume_exit/{name}"] = script.main(resumed)
    # and in another layout again: 2 data x 2 tensor ranks, no pipeline, the key/value head copied
    log = ["--log-file", str(out / "tp_fsdp_resumed_mqa.jsonl")]
    tp_fsdp = [*lm_args(out, "mqa"), "--tp", "2", "--parallel", "fsdp", "--steps", "5", *log]
    exits["tp_fsdp_resume_exit/mqa"] = script.main([*tp_fsdp, "--resume", str(out / "pptp_mqa")])
    saved = [*lm_args(out, "mqa"), "--tp", "2", "--parallel", "fsdp", "--save", str(out / "tp_fsdp_mqa")]
    exits["tp_fsdp_save_exit/mqa"] = script.main(saved)  # saved there, the copied head's rows once
    with moments_as_held():
        control = [*lm_args(out, "llama"), *CHECKPOINTED["llama"], "--save", str(out / "pptp_control")]
        exits["pptp_control_save_exit"] = script.main(control)
    return exits


def loss_fn(out: Tensor | dict[str, Tensor], y: Tensor) -> Tensor:
    """A microbatch's loss: tests/tp_worker.py's ``loss_of`` on the model's output."""
    loss = F.cross_entropy(logits_of(out).flatten(0, -2), y.flatten())
    return loss + tp_worker.ROUTER_LOSS * out["router_loss"] if isinstance(out, dict) else loss


def inputs_of(spec: specvit.Spec, b: dict[str, Tensor]) -> tuple[Tensor, ...]:
    return (b["src"], b["tgt_in"]) if spec.model == "encoder_decoder" else (b["x"],)


def train(text: str, layout: dict[str, Any], pipe_class: type[Pipeline] = Pipeline) -> list[float]:
    """STEPS AdamW steps of a spec's model in a layout; the loss of each step."""
    spec = specvit.parse_spec(text)
    model = tp_worker.build(text)  # on this rank's device
    group = data = None
    dp, tp = layout.get("dp", 1), layout.get("tp", 1)
    if (
        dp * tp > 1
    ):  # a (data, pipeline, tensor) mesh: stages split over tensor ranks, sharded over data ranks
        from torch.distributed.device_mesh import init_device_mesh

        from specvit.parallel import parallelize

        shape = (dp, dist.get_world_size() // (dp * tp), tp)
        mesh = init_device_mesh(tp_worker.DEVICE.type, shape, mesh_dim_names=("dp", "pp", "tp"))
        if tp > 1:
            parallelize(model, mesh["tp"])
        group = mesh["pp"].get_group()
        data = mesh["dp"] if dp > 1 else None
    pipe = pipe_class(
        model,
        loss_fn,
        microbatches=layout["microbatches"],
        schedule=layout["schedule"],
        stages_per_rank=layout.get("stages_per_rank", 1),
        inputs=("src", "tgt") if spec.model == "encoder_decoder" else None,
        group=group,
        device=tp_worker.DEVICE,
        data=data,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        mine, per = data.get_local_rank() if data else 0, tp_worker.BATCH // dp  # this data rank's slice
        b = {
            k: v[mine * per : (mine + 1) * per].to(tp_worker.DEVICE)
            for k, v in tp_worker.batch(spec, step).items()
        }
        opt.zero_grad()
        loss = torch.tensor(pipe.step(*inputs_of(spec, b), target=b["y"]))
        opt.step()
        if data is not None:  # the batch's loss: the mean of the data ranks'
            dist.all_reduce(loss, group=data.get_group())
            loss /= dp
        losses.append(float(loss))
    return losses


class Unsummed(Pipeline):
    """The control: the gradients of weights several stages hold are left per stage."""

    def _finish_grads(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.div_(self.microbatches)


def main(out: Path) -> None:
    if tp_worker.BACKEND == "nccl":
        torch.cuda.set_device(tp_worker.DEVICE)
    dist.init_process_group(tp_worker.BACKEND)
    world = dist.get_world_size()
    results: dict[str, Any] = {"world": world}
    for layout_name, layout in LAYOUTS[world].items():
        for name, text in SPECS.items():
            results[f"{layout_name}/{name}"] = train(text, layout)
    results["control/encdec"] = train(
        SPECS["encdec"], LAYOUTS[2]["1f1b"] if world == 2 else LAYOUTS[4]["1f1b"], Unsummed
    )
    script = tp_worker.load_train_script()
    pp = ["--pp", str(world)]
    results["train_pp_exit"] = script.main([*TRAIN_ARGS, *pp, "--log-file", str(out / "train_pp.jsonl")])
    results["train_pp_save_exit"] = script.main([*TRAIN_ARGS, *pp, "--save", str(out / "pp_checkpoint")])
    one = os.environ.get("SPECVIT_ONE_PROCESS_CHECKPOINT")  # steps 1-3 on one process, resumed in stages
    if one:
        resumed = [
            *TRAIN_ARGS,
            *pp,
            "--resume",
            one,
            "--steps",
            "5",
            "--log-file",
            str(out / "pp_resumed.jsonl"),
        ]
        results["train_pp_resume_exit"] = script.main(resumed)
    if world == 4:  # 2 pipelines of 2 stages, each stage sharded over the 2 data ranks holding it
        log = ["--log-file", str(out / "train_pp_fsdp.jsonl")]
        results["train_pp_fsdp_exit"] = script.main([*TRAIN_ARGS, "--pp", "2", "--parallel", "fsdp", *log])
        save = ["--save", str(out / "pp_fsdp_checkpoint")]
        results["train_pp_fsdp_save_exit"] = script.main(
            [*TRAIN_ARGS, "--pp", "2", "--parallel", "fsdp", *save]
        )
        results.update(pp_tp_checkpoints(script, out))
    dist_worker.finish(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    dist_worker.leave()
