"""Inference rows: ViT-B/16 eager and through ``specvit.optimize`` against HF, onnxruntime, the
encoder-decoder's eval forward against torch.nn.Transformer, and soft-capped attention against Gemma 2's."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import Row, target, timeit_pair

__all__ = ["TRANSFORMER", "softcap_attention_rows", "transformer_eval_rows", "vit_rows"]

ROOT = Path(__file__).resolve().parents[1]

TRANSFORMER = """specvit: 1
name: transformer_base_features
model: encoder_decoder
encoder: &stack
  input: {kind: features, dim: 512}
  position: none
  width: 512
  depth: 6
  block: &block
    heads: 8
    norm: {placement: post, eps: 1.0e-5}
    mlp: {hidden: 2048, activation: relu}
  dropout: {attention: 0.1, projection: 0.1, mlp: 0.1}
decoder:
  <<: *stack
  block:
    <<: *block
    layers: [masked_self_attention, cross_attention, mlp]
"""


def vit_rows(repeat: int, smoke: bool = False) -> list[Row]:
    from transformers import ViTConfig, ViTModel

    import specvit

    over = {"head": "none", **({"encoder.depth": 2} if smoke else {})}
    spec = specvit.load_spec("vit_base_patch16_224", overrides=over)
    ours = specvit.build_model(spec).eval()
    config = ViTConfig(layer_norm_eps=1e-6, num_hidden_layers=2 if smoke else 12)
    config._attn_implementation = "sdpa"
    hf = ViTModel(config, add_pooling_layer=False).eval()
    rows = []
    tag = " [smoke size]" if smoke else ""
    for batch in (1, 8):
        x = torch.randn(batch, 3, 224, 224)
        flops = specvit.build_graph(spec, batch=batch).total_flops
        with torch.inference_mode():
            t_ours, t_hf = timeit_pair(lambda x=x: ours(x), lambda x=x: hf(pixel_values=x), repeat)
        rows.append(
            Row("ViT-B/16 forward, eager" + tag, f"batch {batch}", t_ours, t_hf, "HF ViTModel (sdpa)", flops)
        )
        for precision in ("fp32", "bf16"):
            fast = specvit.optimize(ours, (x,), precision=precision, repeat=repeat)  # type: ignore[arg-type]
            report = fast.optimize_report
            with torch.no_grad():  # as optimize measured (a compiled module guards on the grad mode)
                t_fast, t_eager = timeit_pair(lambda x=x, fast=fast: fast(x), lambda x=x: ours(x), repeat)
            chosen = next(t for t in report.trials if t.name == report.chosen)
            warm = sum(t.warmup_seconds or 0.0 for t in report.trials)
            what = (
                f"batch {batch}; chose '{report.chosen}' ({report.speedup:.2f}x eager when measured); "
                f"measuring took {warm:.0f} s of warm-ups; max abs diff vs eager {chosen.max_abs_diff:.1e}"
            )
            rows.append(
                Row(
                    f"ViT-B/16 forward, specvit.optimize(precision='{precision}')" + tag,
                    what,
                    t_fast,
                    t_eager,
                    "specvit eager",
                    flops,
                )
            )
            if precision == "fp32":
                itself = report.chosen == "eager"  # the model itself: a re-timing measures the machine's noise
                target(
                    f"optimize(fp32) never slower than eager, batch {batch} (re-timed, alternating with eager)",
                    itself or t_fast <= t_eager,
                    f"chose {report.chosen}"
                    + (", the model itself" if itself else f", {report.speedup:.2f}x when measured")
                    + f", {t_eager / t_fast:.2f}x re-timed",
                )
    try:
        import onnxruntime as ort

        from specvit.export import export_onnx

        path = ROOT / "build" / "bench_vit_b16.onnx"
        export_onnx(ours, path)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        x = torch.randn(8, 3, 224, 224)
        with torch.inference_mode():
            t_ort, t_ours = timeit_pair(lambda: session.run(None, {"x": x.numpy()}), lambda: ours(x), repeat)
        flops = specvit.build_graph(spec, batch=8).total_flops
        rows.append(
            Row("ViT-B/16 forward, onnxruntime" + tag, "batch 8", t_ort, t_ours, "specvit eager", flops)
        )
    except ImportError:
        pass
    return rows


def transformer_eval_rows(repeat: int, smoke: bool = False) -> list[Row]:
    import specvit

    spec = specvit.parse_spec(TRANSFORMER)
    layers = 1 if smoke else 6
    if smoke:
        spec = specvit.load_spec(spec, {"encoder.depth": 1, "decoder.depth": 1})
    ours = specvit.build_model(spec).eval()
    peer = torch.nn.Transformer(512, 8, layers, layers, 2048, 0.1, batch_first=True).eval()
    n = 32 if smoke else 128
    src, tgt = torch.randn(8, n, 512), torch.randn(8, n, 512)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(n)
    with torch.inference_mode():
        t_ours, t_peer = timeit_pair(
            lambda: ours(src, tgt), lambda: peer(src, tgt, tgt_mask=causal, tgt_is_causal=True), repeat
        )
    flops = specvit.build_graph(spec, batch=8, src_len=n, tgt_len=n).total_flops
    row = Row(
        f"Encoder-decoder 512/8h/{layers}+{layers}, eval forward",
        f"batch 8, {n}/{n} tokens",
        t_ours,
        t_peer,
        "torch.nn.Transformer",
        flops,
    )
    target(
        "encoder-decoder eval forward no slower than torch.nn.Transformer",
        t_ours <= t_peer,
        f"ratio {row.ratio()}",
    )
    return [row]


def softcap_attention_rows(repeat: int, smoke: bool = False) -> list[Row]:
    """The attention core with soft-capped logits (its math path) against HF's eager Gemma-2 attention, one
    causal GQA layer on the same weights and rotary tables, outputs asserted equal."""
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding

    from specvit.nn.attention import Attention

    heads, kv, hd, b, n = (4, 2, 16, 1, 32) if smoke else (12, 4, 64, 4, 512)
    dim = heads * hd
    config = Gemma2Config(
        hidden_size=dim,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        query_pre_attn_scalar=hd,
        attn_logit_softcapping=50.0,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    peer = Gemma2Attention(config, layer_idx=0).eval()
    ours = Attention(
        dim, heads, num_kv_heads=kv, head_dim=hd, qkv_bias=False, proj_bias=False, softcap=50.0, causal=True
    ).eval()
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([peer.q_proj.weight, peer.k_proj.weight, peer.v_proj.weight]))
        ours.proj.weight.copy_(peer.o_proj.weight)
    x = torch.randn(b, n, dim)
    cos, sin = Gemma2RotaryEmbedding(config)(x, torch.arange(n)[None])
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.inference_mode():
        theirs = peer(x, position_embeddings=(cos, sin), attention_mask=causal)[0]
        diff = (ours(x, rope=(cos[0], sin[0])) - theirs).abs().max().item()
        assert diff < 1e-4, f"soft-capped attention differs from Gemma 2's by {diff}"
        t_ours, t_peer = timeit_pair(
            lambda: ours(x, rope=(cos[0], sin[0])),
            lambda: peer(x, position_embeddings=(cos, sin), attention_mask=causal),
            repeat,
        )
    row = Row(
        "Soft-capped attention (cap 50), eval forward",
        f"{heads} heads / {kv} kv x {hd}, causal, batch {b} x {n} tokens; max abs diff {diff:.1e}",
        t_ours,
        t_peer,
        "HF Gemma2Attention (eager)",
    )
    target(
        "soft-capped attention no slower than HF's eager Gemma-2 attention",
        t_ours <= t_peer,
        f"ratio {row.ratio()}",
    )
    return [row]
