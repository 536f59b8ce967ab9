"""Build rows: building models, lowering and rendering a deep spec."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import Row, fmt_time, target, timeit, timeit_pair

SPECS = Path(__file__).resolve().parents[1] / "specs"
ROOT = SPECS.parent


def build_rows(repeat: int, smoke: bool = False) -> list[Row]:
    from transformers import ViTConfig, ViTModel

    import specvit
    from specvit.diagram import render

    vit_b, vit_h = SPECS / "vit_base_patch16_224.yaml", SPECS / "vit_huge_patch14_224.yaml"
    t_ours, t_hf = timeit_pair(  # alternately: this VM's drift hits both
        lambda: specvit.build_model(vit_b), lambda: ViTModel(ViTConfig(), add_pooling_layer=False), repeat
    )
    rows = [Row("Build", "ViT-B/16 on CPU", t_ours, t_hf, "HF ViTModel(config)")]
    huge = ViTConfig(
        hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120, patch_size=14
    )

    def hf_meta() -> None:
        with torch.device("meta"):
            ViTModel(huge, add_pooling_layer=False)

    t_ours, t_hf = timeit_pair(lambda: specvit.build_model(vit_h, device="meta"), hf_meta, repeat)
    rows.append(Row("Build", "ViT-H/14 on the meta device", t_ours, t_hf, "HF ViTModel(config)"))
    deep = {"encoder.depth": 96}
    t_lower = timeit(lambda: specvit.build_graph(specvit.load_spec(vit_b, overrides=deep)), repeat)
    rows.append(Row("Build", "validate + lower a 96-layer spec", t_lower, None, "-"))
    graph = specvit.build_graph(specvit.load_spec(vit_b, overrides=deep))
    out = ROOT / "build" / "bench_96.svg"
    rows.append(
        Row("Build", "render it, collapsed view (svg)", timeit(lambda: render(graph, out), repeat), None, "-")
    )
    build_b, build_h, lower, draw = rows
    assert build_b.peer is not None
    target(
        "building ViT-B on CPU no slower than the peer",
        build_b.ours <= build_b.peer,
        f"ratio {build_b.ratio()}",
    )
    target("ViT-H on the meta device in < 50 ms", build_h.ours < 0.05, fmt_time(build_h.ours))
    target("validating and lowering a 96-layer spec in < 100 ms", lower.ours < 0.1, fmt_time(lower.ours))
    target("rendering it in < 1 s", draw.ours < 1.0, fmt_time(draw.ours))
    return rows
