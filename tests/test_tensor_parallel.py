"""Tensor parallelism derived from the graph: the plan of a preset, refusals with their numbers, the identity on
one rank, and (slow) training on 2 and 4 gloo ranks that follows one process, via tests/tp_worker.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from reference import printed_by_docs_block

import specvit
from specvit.errors import SpecError
from specvit.parallel import parallelize, plan
from specvit.parallel_styles import (
    ExpertSplit,
    HeadSplit,
    PackedColwise,
    Rowwise,
    TiedHead,
    first_rows,
    rank_major,
)
from specvit.tensor_parallel import describe

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_worker as worker  # tests/ is not a package: import the worker from beside this file

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT = 600  # seconds per launch; 2 ranks take about 30 s, 4 ranks about 80 s on two loaded cores (the
# pipeline workers of tests/test_pipeline.py, launched by the same function, about 20 s and 35 s)
# Split vs one process: the same fp32 maths, but a row-wise layer sums its ranks' partial products (and the
# gradients of the inputs of column-wise layers) in another order, so values differ in the last bits. Seen
# over 5 AdamW steps: at most 4.8e-7 (two ulps of losses near 2.8) on 2 and on 4 ranks. The bound allows
# about 40 ulps; the control below (QK-norm gradients not summed over the ranks) misses by 1e-4 to 7e-4.
LOSS_TOL = 2e-5


def _meta(source: str | Path) -> specvit.SpecModel:
    """A model built on the meta device (nothing allocated) from spec text or a spec file."""
    spec = specvit.parse_spec(source) if isinstance(source, str) else specvit.load_spec(source)
    return specvit.build_model(spec, device="meta")


# ------------------------------------------------------------------------------------------- the plan


def test_plan_of_a_gqa_preset_over_three_ranks() -> None:
    """SmolLM-135M: 9 query and 3 key/value heads, SwiGLU, a tied head; every block alike, folded to ``*``."""
    model = _meta(ROOT / "specs" / "llama_smollm_135m.yaml")
    split = plan(model, 3)
    kinds = {path: type(style).__name__ for path, style in split.items()}
    assert kinds == {
        "decoder.tok_embed": "Rowwise",
        "decoder.blocks.*.attn": "HeadSplit",
        "decoder.blocks.*.attn.qkv": "PackedColwise",
        "decoder.blocks.*.attn.proj": "Rowwise",
        "decoder.blocks.*.mlp.fc1": "PackedColwise",
        "decoder.blocks.*.mlp.fc2": "Rowwise",
        "head.fc": "TiedHead",
    }
    attn, qkv, glu = (
        split["decoder.blocks.*.attn"],
        split["decoder.blocks.*.attn.qkv"],
        split["decoder.blocks.*.mlp.fc1"],
    )
    assert isinstance(attn, HeadSplit) and (attn.heads, attn.kv_heads) == (3, 1)
    assert isinstance(qkv, PackedColwise) and qkv.parts == (576, 192, 192)  # 9 and 3 and 3 heads of 64
    assert isinstance(glu, PackedColwise) and glu.parts == (1536, 1536)  # gate | value
    assert isinstance(split["head.fc"], TiedHead)
    embed = split["decoder.tok_embed"]
    assert isinstance(embed, Rowwise) and "rows 49152 -> 16384 per rank" in embed.note
    text = describe(model, split)
    assert text.splitlines()[-1] == "replicated: decoder.blocks.*.norm1, decoder.blocks.*.norm2, decoder.norm"
    # a model whose blocks differ is not folded: block 0 of the MoE decoder dense, the others experts
    dense_first = "  overrides:\n    - {layers: [0], block: {mlp: {moe: null}}}\nhead:"
    moe = _meta(worker.MOE.replace("head:", dense_first))
    split = plan(moe, 2)
    assert isinstance(split["decoder.blocks.1.mlp"], ExpertSplit) and "decoder.blocks.0.mlp.fc1" in split
    assert "decoder.blocks.*.mlp" not in split and "decoder.blocks.*.attn" in split


def test_plan_refuses_what_does_not_divide_with_the_numbers() -> None:
    vit = ROOT / "specs" / "vit_base_patch16_224.yaml"
    with pytest.raises(SpecError) as caught:
        plan(_meta(vit), 5)
    text = str(caught.value)
    assert "vit_base_patch16_224.yaml:16:14: encoder.blocks.*.attn: heads 12 over 5 ranks" in text
    assert "encoder.blocks.*.mlp: MLP hidden width 3072 over 5 ranks" in text
    assert "the rank counts dividing every split count: 1, 2, 3, 4, 6, 12" in text
    assert len(caught.value.problems) == 3  # heads, key/value heads, hidden: once for the 12 blocks
    assert plan(_meta(vit), 4)  # the control: 4 divides all of them
    lm = worker.LM  # 8 heads, 4 key/value heads
    with pytest.raises(
        SpecError,
        match=r"key/value heads 3 over 2 ranks \(a multiple of 3 ranks copies each key/value head; or",
    ):
        plan(
            _meta(
                lm.replace("width: 64", "width: 48")
                .replace("heads: 8", "heads: 6")
                .replace("kv_heads: 4", "kv_heads: 3")
            ),
            2,
        )
    assert plan(_meta(lm), 4)
    with pytest.raises(SpecError, match=r"decoder.blocks.\*.mlp: experts 4 over 3 ranks") as caught:
        plan(_meta(worker.MOE.replace("heads: 4", "heads: 6").replace("width: 32", "width: 48")), 3)
    assert "heads" not in str(caught.value)  # 6 heads split over 3 ranks: only the experts refused
    with pytest.raises(
        SpecError, match=r"decoder.tok_embed: vocabulary 50257 over 2 ranks \(pad the vocabulary"
    ):
        plan(_meta(ROOT / "specs" / "gpt2_small.yaml"), 2)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("specs/cait_xxs24_224.yaml", "talking heads mix all heads"),
        (
            "docs/examples/alibi_lm.yaml",
            "a per-head bias of all heads from outside the layer (ALiBi, T5 buckets)",
        ),
        ("specs/detr_resnet50.yaml", "positions added to queries and keys only (DETR)"),
        ("specs/swin_tiny_patch4_window7_224.yaml", "a relative position bias table over all heads"),
        ("specs/sagan_attn1_64.yaml", "1x1-conv projections over a map"),
        ("specs/beit_base_patch16_224.yaml", "separate q/v biases of a bias-less qkv"),
    ],
    ids=["talking-heads", "alibi", "detr", "swin", "sagan", "beit"],
)
def test_plan_refuses_parts_that_span_heads(source: str, reason: str) -> None:
    with pytest.raises(SpecError) as caught:
        plan(_meta(ROOT / source), 2)
    assert f"attention heads cannot be split: {reason}" in str(caught.value)
    assert "shard it with FSDP2 instead" in str(caught.value)


def test_rank_major_order_gives_each_rank_whole_parts() -> None:
    """q|k|v of 4|2|2 rows over 2 ranks: rank 0 takes q rows 0-1, k row 4, v row 6; rank 1 the others."""
    assert rank_major((4, 2, 2), 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert rank_major((4, 2, 2), 1).tolist() == list(range(8))  # one rank: the packed order itself
    # 4 query heads and 1 key/value head (rows 4|5 and 6|7) over 4 ranks: every rank holds the copied head
    order = rank_major((4, 2, 2), 4, heads=(4, 1, 1))
    assert order.tolist() == [0, 4, 5, 6, 7, 1, 4, 5, 6, 7, 2, 4, 5, 6, 7, 3, 4, 5, 6, 7]
    assert first_rows(order).tolist() == [0, 5, 10, 15, 1, 2, 3, 4]  # back to the packed order, first copies
    # 2 key/value heads over 4 ranks: ranks 0, 1 hold head 0 (rows 8-9), ranks 2, 3 head 1 (rows 10-11)
    order = rank_major((8, 4), 4, heads=(4, 2))
    assert order.tolist() == [0, 1, 8, 9, 2, 3, 8, 9, 4, 5, 10, 11, 6, 7, 10, 11]
    assert rank_major((4, 2, 2), 2, heads=(2, 2, 2)).tolist() == rank_major((4, 2, 2), 2).tolist()


def test_plan_copies_key_value_heads_over_more_ranks() -> None:
    """8 query and 2 key/value heads over 4 ranks: 2 query heads and 1 key/value head per rank, each key/value
    head on 2 ranks; 2 key/value heads over 3 ranks is refused (neither count divides the other)."""
    split = plan(_meta(worker.LM.replace("kv_heads: 4", "kv_heads: 2")), 4)
    attn, qkv = split["decoder.blocks.*.attn"], split["decoder.blocks.*.attn.qkv"]
    assert isinstance(attn, HeadSplit) and (attn.heads, attn.kv_heads) == (2, 1)
    assert "key/value heads 2 -> 1 per rank (each on 2 ranks, its copies' gradients summed)" in attn.note
    assert isinstance(qkv, PackedColwise) and qkv.heads == (8, 2, 2)
    assert qkv.note == "column-wise by head, packed q|k|v rows 64|16|16 -> 16|8|8 per rank"
    lm = worker.LM.replace("width: 64", "width: 48").replace("heads: 8", "heads: 6")
    with pytest.raises(SpecError, match=r"key/value heads 2 over 3 ranks"):
        plan(_meta(lm.replace("kv_heads: 4", "kv_heads: 2")), 3)


@pytest.fixture
def one_rank() -> Iterator[Any]:
    """A gloo process group of one rank in this process, and its mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["llama", "encdec", "moe"])
def test_parallelize_over_one_rank_is_the_identity(name: str, one_rank: Any) -> None:
    """Split over one rank: the same state dict and the same loss and gradients as the plain model."""
    from specvit.parallel import full_state_dict

    spec = specvit.parse_spec(worker.SPECS[name])
    plain, split = worker.build(worker.SPECS[name]), worker.build(worker.SPECS[name])
    parallelize(split, one_rank)
    assert any(isinstance(p, torch.distributed.tensor.DTensor) for p in split.parameters())
    state = full_state_dict(split)
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    b = worker.batch(spec, 0)
    want, got = worker.loss_of(plain, spec, b), worker.loss_of(split, spec, b)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(TypeError, match="already split over 1 ranks"):
        parallelize(split, one_rank)


# ---------------------------------------------------------------------------------- torchrun, 2 and 4


@contextmanager
def _one_thread() -> Iterator[None]:
    """One thread in this process, as each rank runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def one_process_losses(text: str, ranks: int = 1) -> list[float]:
    """A spec's model trained in one process as the ranks train it. With ``ranks`` data ranks (or
    microbatches) each step's loss is the mean of the slices' (an MoE's load-balancing loss is computed per
    slice, so it is not the whole batch's)."""
    with _one_thread():
        model = worker.build(text)
        return worker.train(model, model.spec, ranks=ranks)


def _single(name: str, ranks: int = 1) -> list[float]:
    return one_process_losses(worker.SPECS[name], ranks)


def train_script(base: list[str], *args: str) -> int:
    """examples/train.py with ``base`` and ``args`` on one thread of this process; its exit status."""
    with _one_thread():
        return int(worker.load_train_script().main([*base, *args]))


def _one_process(*args: str) -> int:
    return train_script(worker.TRAIN_ARGS, *args)


def _log(path: Path) -> list[float]:
    """The losses a train.py ``--log`` file holds, step by step."""
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def launch(script: str, base: list[str], world: int, out: Path, backend: str) -> dict[str, Any]:
    """tests/``script`` under ``torchrun --nproc_per_node world``, after a one-process checkpoint of train.py
    with ``base`` (steps 1-3) for the worker to resume; its results.json, which must exit 0 on every rank."""
    out.mkdir(parents=True, exist_ok=True)
    assert train_script(base, "--save", str(out / "one_checkpoint")) == 0
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SPECVIT_ONE_PROCESS_CHECKPOINT": str(out / "one_checkpoint"),
        "SPECVIT_TEST_BACKEND": backend,
    }
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node",
        str(world),
        str(ROOT / "tests" / script),
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]  # every run exits 0
    return {**json.loads((out / "results.json").read_text()), "out": out}


@functools.cache
def _launch(world: int, out: Path, backend: str = "gloo") -> dict[str, Any]:
    return launch("tp_worker.py", worker.TRAIN_ARGS, world, out, backend)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def tp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _launch(request.param, tmp_path_factory.mktemp(f"tp_{request.param}"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_split_training_follows_one_process(name: str, tp_run: dict[str, Any]) -> None:
    single = _single(name)
    assert len(set(single)) == worker.STEPS  # the loss moves: the steps are not no-ops
    split = tp_run[f"{name}/losses"]
    diff = max(abs(a - b) for a, b in zip(split, single, strict=True))
    print(f"{name} on {tp_run['world']} ranks vs one process, max |loss difference| over 5 steps: {diff:.2e}")
    assert diff <= LOSS_TOL, (split, single)
    assert tp_run[f"{name}/state_equal"]  # gathered before training: the very weights it was split from
    assert tp_run[f"{name}/reloaded_equal"]  # loaded back in one process's order: the same again
    assert tp_run[f"{name}/twice"] == f"the model is already split over {tp_run['world']} ranks"
    # what `specvit summary --tp N` says a rank holds is what a split rank holds
    assert tp_run[f"{name}/local_params"] == tp_run[f"{name}/predicted_params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_tensor_parallel_inside_fsdp2_on_a_2d_mesh_follows_one_process(
    name: str, tp_run: dict[str, Any]
) -> None:
    """4 ranks as 2 data x 2 tensor ranks: parallelize over the tensor ranks, shard over the data ranks."""
    if tp_run["world"] != 4:
        pytest.skip("the 2-D mesh needs 4 ranks")
    split, single = tp_run[f"{name}/2d/losses"], _single(name, 2)
    diff = max(abs(a - b) for a, b in zip(split, single, strict=True))
    print(f"{name} on 2 x 2 ranks vs one process, max |loss difference| over 5 steps: {diff:.2e}")
    assert diff <= LOSS_TOL, (split, single)
    whole = _single(name)  # the control for the MoE: the whole batch's balancing loss is another curve
    assert name != "moe" or max(abs(a - b) for a, b in zip(split, whole, strict=True)) > 5 * LOSS_TOL


@pytest.mark.slow
def test_split_shapes_and_the_control(tp_run: dict[str, Any]) -> None:
    n = tp_run["world"]
    llama = tp_run["llama/facts"]
    assert llama["heads"]["decoder.blocks.0.attn"] == [8 // n, 4 // n]  # the layer computes its local heads
    assert llama["local"]["decoder.blocks.0.attn.qkv.weight"] == [
        [128 // n, 64],
        "S(0)",
    ]  # (8 + 4 + 4) x 8 rows
    assert llama["local"]["decoder.blocks.0.attn.proj.weight"] == [[64, 64 // n], "S(1)"]
    assert llama["local"]["head.fc.weight"] == [[16 // n, 64], "S(0)"]  # untied LM head: vocabulary split
    moe = tp_run["moe/facts"]["local"]
    assert moe["decoder.blocks.0.mlp.fc1"] == [[4 // n, 64, 32], "S(0)"]  # whole experts per rank
    assert moe["decoder.tok_embed.weight"] == [
        [16 // n, 32],
        "S(0)",
    ]  # tied: the head has no weight of its own
    assert "head.fc.weight" not in moe
    mqa = tp_run["mqa/facts"]  # one key/value head, copied: each rank holds all of it
    assert mqa["heads"]["decoder.blocks.0.attn"] == [8 // n, 1]
    assert mqa["local"]["decoder.blocks.0.attn.qkv.weight"] == [[64 // n + 8 + 8, 64], "S(0)"]
    # the controls: QK-norm weights' gradients, or a copied key/value head's, left per rank -> the curve
    # leaves one process's
    for name, control in (("llama", tp_run["llama/unsummed/losses"]), ("mqa", tp_run["mqa/uncopied/losses"])):
        assert max(abs(a - b) for a, b in zip(control, _single(name), strict=True)) > 5 * LOSS_TOL


@pytest.mark.slow
def test_train_script_with_tp_follows_one_process(tp_run: dict[str, Any], tmp_path: Path) -> None:
    """examples/train.py --tp N (every rank the whole batch) vs the same command on one process."""
    assert tp_run["train_tp_exit"] == 0
    assert tp_run["train_tp_refused_exit"] == 2  # heads 1 over N ranks: refused with the spec's message
    assert _one_process("--log", str(tmp_path / "one.jsonl")) == 0
    runs = ["train_tp.jsonl"] + (["train_2d.jsonl"] if tp_run["world"] == 4 else [])  # and --tp 2 x fsdp 2
    assert tp_run.get("train_2d_exit", 0) == 0
    one, *split = [_log(path) for path in (tmp_path / "one.jsonl", *(tp_run["out"] / run for run in runs))]
    assert len(one) == 3 and len(set(one)) == 3
    for losses in split:
        assert max(abs(a - b) for a, b in zip(one, losses, strict=True)) <= LOSS_TOL


@pytest.mark.slow
def test_a_checkpoint_saved_split_resumes_on_one_process_and_back(
    tp_run: dict[str, Any], tmp_path: Path
) -> None:
    """Steps 1-3 saved at tp N resume on one process, and steps 1-3 saved on one process resume at tp N: steps
    4-5 are the uninterrupted one-process run's (weights and AdamW moments in one process's order)."""
    assert tp_run["train_tp_save_exit"] == 0 and tp_run["train_tp_resume_exit"] == 0
    assert _one_process("--steps", "5", "--log", str(tmp_path / "whole.jsonl")) == 0
    resumed = ["--resume", str(tp_run["out"] / "tp_checkpoint"), "--steps", "5"]
    assert _one_process(*resumed, "--log", str(tmp_path / "resumed.jsonl")) == 0
    whole = _log(tmp_path / "whole.jsonl")
    assert len(whole) == 5 and len(set(whole)) == 5
    for later in (_log(tmp_path / "resumed.jsonl"), _log(tp_run["out"] / "tp_resumed.jsonl")):
        assert len(later) == 2
        assert max(abs(a - b) for a, b in zip(later, whole[3:], strict=True)) <= LOSS_TOL


def test_train_script_refuses_tp_without_its_processes(capsys: pytest.CaptureFixture[str]) -> None:
    script = worker.load_train_script()
    assert script.main([*worker.TRAIN_ARGS, "--tp", "2"]) == 2
    assert (
        "--tp 2 splits over 2 processes, 1 were started: torchrun --nproc_per_node 2"
        in capsys.readouterr().err
    )
    assert script.main([*worker.TRAIN_ARGS, "--tp", "2", "--parallel", "fsdp"]) == 2
    assert (
        "--tp 2 splits over 2 processes, 1 were started: torchrun --nproc_per_node a multiple of 2 (data x "
        "tensor ranks)" in capsys.readouterr().err
    )
    assert script.main([*worker.TRAIN_ARGS, "--tp", "2", "--parallel", "ddp"]) == 2
    assert "--tp with --parallel ddp is not supported: --parallel fsdp shards the data ranks" in (
        capsys.readouterr().err
    )


# ----------------------------------------------------------------------------------------------- docs


def test_plan_in_the_docs_is_the_generators() -> None:
    doc = (ROOT / "docs" / "distributed.md").read_text()
    text = printed_by_docs_block(ROOT / "docs" / "distributed.md", "describe(")
    assert text.count("\n") >= 7 and f"```\n{text}\n```" in doc


CUDA_TOL = 1e-4
"""GPUs sum fp32 products in other orders than one CPU process (and cuBLAS picks its kernels by shape): 5
steps stay within 1e-4 of one process, as the DDP/FSDP2 tests allow."""


def gpus(needed: int) -> None:
    """Skip, in one line, unless ``needed`` CUDA GPUs are present for an NCCL run."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < needed:
        pytest.skip(
            f"NCCL runs need {needed} CUDA GPUs, this machine has {found}: the gloo runs above cover CPUs"
        )


@pytest.mark.slow
def test_tensor_parallel_on_cuda_gpus_with_nccl(tmp_path: Path) -> None:
    """The 2-rank worker on NCCL, every rank on its GPU: split training follows one CPU process."""
    gpus(2)
    run = _launch(2, tmp_path, "nccl")
    for name in worker.SPECS:
        diff = max(abs(a - b) for a, b in zip(run[f"{name}/losses"], _single(name), strict=True))
        assert diff <= CUDA_TOL, (name, diff)
