"""Pipeline parallelism derived from the graph: stages cut at the blocks ``summary --pp`` cuts, their forward
in one process equal to the model's, the weights each holds; and (slow) training on 2 and 4 gloo ranks with
1F1B, GPipe and interleaved schedules, and with tensor parallelism inside the stages, that follows one
process, and checkpoints of those layouts that resume in others (pipeline x tensor parallel among them), via
tests/pp_worker.py."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import specvit
from specvit.errors import SpecError
from specvit.parallel_layout import pipeline_stages
from specvit.pipeline import Pipeline, _keep_only, run_split, split

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pp_worker as worker  # tests/ is not a package: import the worker from beside this file
import tp_worker
from test_tensor_parallel import CUDA_TOL, _log, gpus, launch, one_process_losses, train_script

# Stages vs one process: the same fp32 maths on the same microbatches, but the microbatches' gradients are
# accumulated in another order (and, with tensor parallelism inside, split layers sum partial products), so
# values differ in the last bits: seen over 5 AdamW steps, at most 9.5e-7 (four ulps of losses near 3). The
# bound allows about 40 ulps; the control (a shared embedding's gradients left per stage) misses by 1e-3 to 3e-2.
LOSS_TOL = 2e-5


def _inputs(model: specvit.SpecModel) -> tuple[torch.Tensor, ...]:
    b = tp_worker.batch(model.spec, 0)
    return worker.inputs_of(model.spec, b)


@pytest.mark.parametrize("name", sorted(worker.SPECS))
@pytest.mark.parametrize("stages", [2, 4])
def test_stages_run_one_after_another_are_the_model(name: str, stages: int) -> None:
    model = tp_worker.build(worker.SPECS[name])
    inputs = _inputs(model)
    names = ("src", "tgt") if model.spec.model == "encoder_decoder" else None
    cut = split(model, stages, names)
    assert [s.blocks for s in cut] == [
        c.blocks for c in pipeline_stages(model.graph, stages)
    ]  # summary's cut
    expected, got = model(*inputs), run_split(cut, *inputs)
    if isinstance(expected, dict):  # an MoE model's logits and router loss: the dict is made again
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    else:
        assert torch.equal(got, expected)
    # every weight is on a stage, under the model's name; only shared ones on more than one
    keys = [k for s in cut for k in s.module.state_dict()]
    assert set(keys) == set(model.state_dict())
    shared = {k for s in cut for k in s.shared}
    assert len(keys) - len(set(keys)) == sum(sum(k in s.shared for s in cut) - 1 for k in shared)


def test_what_crosses_each_cut() -> None:
    """An encoder-decoder in 4 stages: the decoder's token ids ride the encoder stages, the memory every
    decoder stage; the shared embedding is held by the stages that embed and by the tied head's."""
    model = tp_worker.build(worker.SPECS["encdec"])
    cut = split(model, 4, ("src", "tgt"))
    assert [s.blocks for s in cut] == [
        ("encoder.blocks.0",),
        ("encoder.blocks.1",),
        ("decoder.blocks.0",),
        ("decoder.blocks.1",),
    ]
    assert [s.inputs for s in cut] == [
        ["src", "tgt"],
        ["tgt", "encoder_blocks_0"],
        ["tgt", "encoder_norm"],
        ["encoder_norm", "decoder_blocks_0"],
    ]
    assert [sorted(s.shared) for s in cut] == [
        ["encoder.tok_embed.weight"],
        [],
        *[["encoder.tok_embed.weight"]] * 2,
    ]
    lm = split(tp_worker.build(worker.SPECS["llama"]), 2)  # rotary tables cross as their two tensors
    assert lm[0].outputs == ["decoder_rope_0", "decoder_rope_1", "decoder_blocks_1"]
    assert lm[1].shared == {}  # an untied head: nothing shared


def test_a_relayed_value_is_what_the_next_stage_reads() -> None:
    """The control for the equality above: the same stages fed a wrong relayed memory give another output."""
    model = tp_worker.build(worker.SPECS["encdec"])
    inputs = _inputs(model)
    cut = split(model, 3, ("src", "tgt"))
    tgt, memory = cut[0].module(*inputs)
    wrong = cut[2].module(*cut[1].module(tgt, torch.zeros_like(memory)))
    assert not torch.equal(wrong, model(*inputs))
    assert torch.equal(cut[2].module(*cut[1].module(tgt, memory)), model(*inputs))


def test_refusals_name_the_numbers() -> None:
    model = tp_worker.build(worker.SPECS["vit"])
    with pytest.raises(
        SpecError, match=r"5 pipeline stages for 4 blocks in 1 stack \(use --pp 1, or at most 4"
    ):
        split(model, 5)
    encdec = tp_worker.build(worker.SPECS["encdec"])
    with pytest.raises(SpecError, match=r"5 pipeline stages for 4 blocks in 2 stacks"):
        split(encdec, 5, ("src", "tgt"))
    with pytest.raises(TypeError, match=r"inputs: \['images'\] are not arguments of the model's forward"):
        split(model, 2, ("images",))
    with pytest.raises(
        TypeError, match=r"the model's required argument\(s\) \['tgt'\] must be among the inputs"
    ):
        split(encdec, 2, ("src",))


def test_pipeline_refuses_unknown_schedules() -> None:
    model = tp_worker.build(worker.SPECS["vit"])
    with pytest.raises(
        ValueError, match=r"schedule must be one of \('1f1b', 'gpipe', 'interleaved'\), got 'zb'"
    ):
        Pipeline(model, worker.loss_fn, microbatches=2, schedule="zb")
    with pytest.raises(ValueError, match=r"stages_per_rank=2 needs schedule='interleaved'"):
        Pipeline(model, worker.loss_fn, microbatches=2, stages_per_rank=2)


# ---------------------------------------------------------------------------------- torchrun, 2 and 4


def _single(name: str, microbatches: int) -> list[float]:
    """One process trained on the same microbatches: each step's loss the mean of theirs."""
    return one_process_losses(worker.SPECS[name], microbatches)


def _one_process(*args: str) -> int:
    return train_script(worker.TRAIN_ARGS, *args)


@functools.cache
def _launch(world: int, out: Path, backend: str = "gloo") -> dict[str, Any]:
    if world == 4:  # the decoders' spec files and one-process checkpoints of steps 1-3, for the worker
        out.mkdir(parents=True, exist_ok=True)
        for name in worker.CHECKPOINTED:
            (out / f"{name}.yaml").write_text(worker.SPECS[name])
            assert train_script(worker.lm_args(out, name), "--save", str(out / f"one_{name}")) == 0
    return launch("pp_worker.py", worker.TRAIN_ARGS, world, out, backend)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def pp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _launch(request.param, tmp_path_factory.mktemp(f"pp_{request.param}"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(worker.SPECS))
def test_pipelined_training_follows_one_process(name: str, pp_run: dict[str, Any]) -> None:
    for layout, settings in worker.LAYOUTS[pp_run["world"]].items():
        single = _single(name, settings["microbatches"] * settings.get("dp", 1))  # every slice's loss
        assert len(set(single)) == worker.STEPS  # the loss moves: the steps are not no-ops
        staged = pp_run[f"{layout}/{name}"]
        diff = max(abs(a - b) for a, b in zip(staged, single, strict=True))
        print(
            f"{name}, {layout} on {pp_run['world']} ranks vs one process, max |loss difference|: {diff:.2e}"
        )
        assert diff <= LOSS_TOL, (layout, staged, single)


@pytest.mark.slow
def test_the_control_leaves_one_process(pp_run: dict[str, Any]) -> None:
    """The shared embedding's gradients not summed over the stages holding it: the curve leaves one process's."""
    micro = worker.LAYOUTS[pp_run["world"]]["1f1b"]["microbatches"]
    control = pp_run["control/encdec"]
    assert max(abs(a - b) for a, b in zip(control, _single("encdec", micro), strict=True)) > 5 * LOSS_TOL


@pytest.mark.slow
def test_train_script_with_pp_follows_one_process_and_checkpoints_cross_layouts(
    pp_run: dict[str, Any], tmp_path: Path
) -> None:
    """examples/train.py --pp N vs one process; steps 1-3 saved in stages resume on one process, and steps 1-3
    saved on one process resume in stages: steps 4-5 as the uninterrupted one-process run."""
    out = pp_run["out"]
    assert (pp_run["train_pp_exit"], pp_run["train_pp_save_exit"], pp_run["train_pp_resume_exit"]) == (
        0,
        0,
        0,
    )
    assert _one_process("--steps", "5", "--log", str(tmp_path / "one.jsonl")) == 0
    one = _log(tmp_path / "one.jsonl")
    assert len(set(one)) == 5
    assert max(abs(a - b) for a, b in zip(one[:3], _log(out / "train_pp.jsonl"), strict=True)) <= LOSS_TOL
    assert max(abs(a - b) for a, b in zip(one[3:], _log(out / "pp_resumed.jsonl"), strict=True)) <= LOSS_TOL
    for saved in ["pp_checkpoint"] + (["pp_fsdp_checkpoint"] if pp_run["world"] == 4 else []):
        back = tmp_path / f"{saved}.jsonl"
        assert _one_process("--resume", str(out / saved), "--steps", "5", "--log", str(back)) == 0
        assert max(abs(a - b) for a, b in zip(one[3:], _log(back), strict=True)) <= LOSS_TOL
    if pp_run["world"] == 4:  # --pp 2 --parallel fsdp: 2 pipelines, each stage sharded over 2 data ranks
        assert (pp_run["train_pp_fsdp_exit"], pp_run["train_pp_fsdp_save_exit"]) == (0, 0)
        fsdp = _log(out / "train_pp_fsdp.jsonl")
        assert max(abs(a - b) for a, b in zip(one[:3], fsdp, strict=True)) <= LOSS_TOL


@pytest.mark.slow
def test_checkpoints_of_pipeline_x_tensor_parallel_runs_cross_layouts(
    pp_run: dict[str, Any], tmp_path: Path
) -> None:
    """Decoders with packed q|k|v (GQA; MQA, its key/value head copied on both tensor ranks, with FSDP2 inside
    the stages): steps 1-3 saved at --pp 2 --tp 2 resume on one process (and the MQA's at --tp 2 --parallel
    fsdp, whose own save resumes on one process), and steps 1-3 saved on one process resume at --pp 2 --tp 2: steps 4-5 are the uninterrupted
    one-process run's, the weights and AdamW's moments having been saved in one process's order. The control,
    whose moments were saved as the ranks hold them, resumes with the right weights (step 4) but leaves the
    curve at step 5."""
    if pp_run["world"] != 4:
        pytest.skip("2 stages x 2 tensor ranks need 4 ranks")
    out = pp_run["out"]
    whole = {}
    for name in worker.CHECKPOINTED:
        assert (pp_run[f"pptp_save_exit/{name}"], pp_run[f"pptp_resume_exit/{name}"]) == (0, 0)
        base = worker.lm_args(out, name)
        assert train_script(base, "--steps", "5", "--log", str(tmp_path / f"{name}.jsonl")) == 0
        whole[name] = _log(tmp_path / f"{name}.jsonl")
        assert len(set(whole[name])) == 5  # the loss moves
        back = tmp_path / f"{name}_back.jsonl"
        resumed = ["--resume", str(out / f"pptp_{name}"), "--steps", "5", "--log", str(back)]
        assert train_script(base, *resumed) == 0
        logs = [back, out / f"pptp_resumed_{name}.jsonl"]  # saved at pp x tp; saved on one process
        if name == "mqa":  # saved at pp x tp x fsdp, resumed at tp x fsdp; saved at tp x fsdp, on one process
            logs.append(out / "tp_fsdp_resumed_mqa.jsonl")
            logs.append(tmp_path / "from_tp_fsdp.jsonl")
            from_tp = ["--resume", str(out / "tp_fsdp_mqa"), "--steps", "5", "--log", str(logs[-1])]
            assert pp_run["tp_fsdp_save_exit/mqa"] == 0 and train_script(base, *from_tp) == 0
        for log in logs:
            later = _log(log)
            assert len(later) == 2
            diff = max(abs(a - b) for a, b in zip(later, whole[name][3:], strict=True))
            print(f"{name}, {log.name}: max |loss difference| over steps 4-5 vs one process: {diff:.2e}")
            assert diff <= LOSS_TOL, (log.name, later, whole[name][3:])
    assert pp_run["tp_fsdp_resume_exit/mqa"] == 0 and pp_run["pptp_control_save_exit"] == 0
    control = tmp_path / "control.jsonl"
    resumed = ["--resume", str(out / "pptp_control"), "--steps", "5", "--log", str(control)]
    assert train_script(worker.lm_args(out, "llama"), *resumed) == 0
    got = _log(control)
    print(
        f"control vs one process, steps 4 and 5: {abs(got[0] - whole['llama'][3]):.2e}, "
        f"{abs(got[1] - whole['llama'][4]):.2e}"
    )
    assert abs(got[0] - whole["llama"][3]) <= LOSS_TOL  # the weights were saved right
    assert abs(got[1] - whole["llama"][4]) > 5 * LOSS_TOL  # the moments were not


@pytest.mark.parametrize("name", ["encdec", "moe"])
def test_a_rank_holds_only_its_stages_weights(name: str) -> None:
    """A meta build: the last stage's weights (the tied head's embedding among them) materialised and drawn
    as a one-process build draws them under the same seed, the others left meta; a built model: the others
    dropped to meta, its own kept as they were."""
    text = worker.SPECS[name]
    whole = tp_worker.build(text).state_dict()
    torch.manual_seed(0)
    model = specvit.build_model(specvit.parse_spec(text), device="meta")
    names = ("src", "tgt") if model.spec.model == "encoder_decoder" else None
    cut = split(model, 2, names)
    _keep_only(model, cut[1:], torch.device("cpu"))
    mine = cut[1].module.state_dict()
    assert mine and all(torch.equal(v, whole[k]) for k, v in mine.items())
    assert any(k.endswith("tok_embed.weight") for k in mine)  # borrowed by the tied head
    others = {k: v for k, v in model.state_dict().items() if k not in mine}
    assert others and all(v.is_meta for v in others.values())
    control = specvit.build_model(specvit.parse_spec(text), device="meta")  # another seed's draws differ
    cut = split(control, 2, names)
    _keep_only(control, cut[1:], torch.device("cpu"))
    assert not all(torch.equal(v, whole[k]) for k, v in cut[1].module.state_dict().items())
    built = tp_worker.build(text)
    cut = split(built, 2, names)
    _keep_only(built, cut[:1], torch.device("cpu"))
    assert all(torch.equal(v, whole[k]) for k, v in cut[0].module.state_dict().items())
    assert all(v.is_meta for k, v in built.state_dict().items() if k not in cut[0].module.state_dict())


@pytest.mark.slow
def test_pipelines_on_cuda_gpus_with_nccl(tmp_path: Path) -> None:
    """The 2-rank worker on NCCL, each stage on its GPU: every schedule follows one CPU process."""
    gpus(2)
    run = _launch(2, tmp_path, "nccl")
    for layout, settings in worker.LAYOUTS[2].items():
        for name in worker.SPECS:
            single = _single(name, settings["microbatches"])
            diff = max(abs(a - b) for a, b in zip(run[f"{layout}/{name}"], single, strict=True))
            assert diff <= CUDA_TOL, (layout, name, diff)
