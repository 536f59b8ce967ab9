"""``specvit summary --tp/--pp/--dp``: pipeline stages balanced by the graph's FLOPs, then its parameters (an
encoder-decoder cut at its boundary), parameters per rank under the derived tensor-parallel plan, counted by
hand here; the counts on real split ranks are checked by tests/test_tensor_parallel.py's slow run."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import specvit
from specvit.cli import main
from specvit.errors import SpecError
from specvit.graph import ArchGraph, build_graph
from specvit.parallel_layout import _owners, layout_report, pipeline_stages

TINY_GPT = {
    "decoder.depth": 2,
    "decoder.width": 64,
    "decoder.block.heads": 4,
    "decoder.input.vocab": 96,
    "decoder.position.max_len": 32,
}


def _tiny() -> specvit.Spec:
    return specvit.load_spec("gpt2_small", overrides=TINY_GPT)


def test_one_rank_holds_the_whole_model() -> None:
    for name in ("gpt2_small", "transformer_base"):  # a tied head counted once; two stacks
        spec = specvit.load_spec(name)
        (stage,) = layout_report(spec).stages
        assert stage.params == build_graph(spec).total_params
        assert stage.state_bytes == 16 * stage.params  # fp32 value, gradient, exp_avg, exp_avg_sq
        assert stage.sent == {"tp": 0, "pp": 0, "dp": 0}


def test_tensor_ranks_split_what_the_plan_splits() -> None:
    """Per block: norms whole; q/k/v and fc1 column-wise (weight and bias halved); proj and fc2 row-wise
    (weight halved, bias whole). Outside: the token embedding vocabulary-parallel, the positions whole."""
    block = 128 + (12288 + 192) // 2 + 4096 // 2 + 64 + 128 + (16384 + 256) // 2 + 16384 // 2 + 64
    want = 2 * block + 6144 // 2 + 2048 + 128
    report = layout_report(_tiny(), tp=2)
    assert report.stages[0].params == want == 55616
    whole = layout_report(_tiny()).stages[0].params
    assert whole == 108288 and whole != want  # the control: one rank holds everything


def test_fsdp_shards_the_state_and_ddp_all_reduces_the_gradients() -> None:
    spec = _tiny()
    ddp, fsdp = layout_report(spec, dp=4).stages[0], layout_report(spec, dp=4, fsdp=True).stages[0]
    assert ddp.state_bytes == 16 * 108288 and fsdp.state_bytes == 16 * 108288 // 4
    assert ddp.sent["dp"] == int(4 * 108288 * 2 * 3 / 4)  # ring all-reduce: 2 (N - 1) / N of the bytes
    assert fsdp.sent["dp"] == int(4 * 108288 * 3 * 3 / 4)  # two all-gathers and a reduce-scatter


def _runs(graph: ArchGraph, cut: tuple[int, ...]) -> list[tuple[int, int]]:
    return list(itertools.pairwise((0, *cut, len(_owners(graph)))))


@pytest.mark.parametrize(
    ("name", "stages"), [("vit_tiny_patch16_224", 3), ("gpt2_small", 4), ("bloom_560m", 4)]
)
def test_stages_are_the_fastest_cut_then_the_most_even_in_flops_and_parameters(
    name: str, stages: int
) -> None:
    """Against every cut: the heaviest stage's FLOPs least, then the least sum of squared shares of FLOPs and
    parameters; each stage's parameters as the meta-built model's (a tied head's embedding on both stages)."""
    spec = specvit.load_spec(name)
    graph = build_graph(spec)
    got = pipeline_stages(graph, stages)
    assert sum(s.flops for s in got) == graph.total_flops  # every node in exactly one stage
    assert sorted(n for s in got for n in s.nodes) == sorted(graph.nx.nodes)
    assert [s.params for s in got] == [s.params for s in layout_report(spec, pp=stages).stages]
    owned = _owners(graph)
    flops = [sum(int(graph.nx.nodes[n]["flops"]) for n in b.nodes) for b in owned]
    params = [sum(int(graph.nx.nodes[n]["params"]) for n in b.nodes) for b in owned]
    tied = name != "vit_tiny_patch16_224"  # the LM head, in the last block, reads the first block's embedding
    embedding = graph.nx.nodes["decoder.tok_embed"]["params"] if tied else 0

    def shares(cut: tuple[int, ...]) -> tuple[list[float], list[float]]:
        runs = _runs(graph, cut)
        f = [sum(flops[a:b]) / graph.total_flops for a, b in runs]
        p = [
            (sum(params[a:b]) + embedding * (b == len(owned) and a > 0)) / graph.total_params for a, b in runs
        ]
        return f, p

    cuts = list(itertools.combinations(range(1, len(owned)), stages - 1))
    fastest = min(max(shares(cut)[0]) for cut in cuts)
    even = lambda cut: sum(x * x for x in shares(cut)[0] + shares(cut)[1])  # noqa: E731
    best = min(even(cut) for cut in cuts if max(shares(cut)[0]) == fastest)
    mine = tuple(itertools.accumulate(len(s.blocks) for s in got[:-1]))
    assert max(shares(mine)[0]) == fastest and even(mine) == pytest.approx(best, rel=1e-12)
    # the control: the fastest cut the DP finds with FLOPs alone holds less even parameters
    flops_only = {"gpt2_small": (3, 7, 11), "bloom_560m": (7, 15, 23)}.get(name)
    if flops_only is not None:
        assert max(shares(flops_only)[0]) == fastest and even(flops_only) > best * (1 + 1e-9)
        assert max(shares(flops_only)[1]) > max(shares(mine)[1])


def test_an_encoder_decoder_is_cut_at_its_boundary_and_bad_counts_are_refused() -> None:
    graph = build_graph(specvit.load_spec("transformer_base"))
    two = pipeline_stages(graph, 2)
    assert [s.blocks[0] for s in two] == ["encoder.blocks.0", "decoder.blocks.0"]
    assert two[0].blocks[-1] == "encoder.blocks.5"
    for stage in pipeline_stages(graph, 5):
        assert len({b.split(".")[0] for b in stage.blocks}) == 1
    with pytest.raises(
        SpecError, match=r"13 pipeline stages for 12 blocks in 2 stacks \(use --pp 1, or from 2"
    ):
        pipeline_stages(graph, 13)


def test_summary_prints_the_layout_and_refuses_what_the_plan_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sets = [a for k, v in TINY_GPT.items() for a in ("--set", f"{k}={v}")]
    assert main(["summary", "gpt2_small", *sets, "--tp", "2", "--pp", "2", "--dp", "2", "--fsdp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "gpt2_small: tp 2 x pp 2 x dp 2 (FSDP2) = 8 ranks; batch 1 per data rank in 2 microbatches"
    )
    assert "decoder.blocks.0 " in out and "decoder.blocks.1 " in out
    assert main(["summary", "gpt2_small", "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "vocabulary 50257 over 4 ranks (pad the vocabulary to a multiple of 4" in err


def test_render_frames_each_pipeline_stage_and_folds_within_it(tmp_path: Path) -> None:
    from specvit.diagram import RenderError, render

    dot = (render("gpt2_small", tmp_path / "pp.dot", pp=3)).read_text()
    for title in ("pipeline stage 0: decoder.blocks.0-4", "pipeline stage 1: decoder.blocks.5-10",
                  "pipeline stage 2: decoder.blocks.11"):  # fmt: skip
        assert title in dot
    assert "decoder.blocks.0-4  x5" in dot and "decoder.blocks.5-10  x6" in dot  # no run crosses a cut
    plain = (render("gpt2_small", tmp_path / "plain.dot")).read_text()
    assert "decoder.blocks.0-11  x12" in plain and "pipeline stage" not in plain  # the control
    with pytest.raises(
        RenderError, match=r"--pp frames pipeline stages in .svg, .png, .pdf and .dot drawings"
    ):
        render("gpt2_small", tmp_path / "pp.html", pp=2)
    assert not (tmp_path / "pp.html").exists()
    assert main(["render", "transformer_base", "--pp", "13", "-o", str(tmp_path / "x.svg")]) == 2
    assert not (tmp_path / "x.svg").exists()
