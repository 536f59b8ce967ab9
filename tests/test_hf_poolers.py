"""Base models with their pooler (issue #25): ``from_hf(BertModel(config))`` and every class HF builds with a
pooler by default, or that always computes a ``pooler_output`` (CLIP's and SigLIP's towers, DINOv2), read as a
``classifier`` head with ``tokens: true``, whose model returns HF's ``last_hidden_state`` and ``pooler_output``.

Each case checks both outputs against HF's (fp32, every weight moved by N(0, 0.08)), the round trip through
``to_hf`` (AutoModel loads the directory with equal outputs) and ``from_pretrained`` of HF's own
``save_pretrained`` directory; the broken control of each swaps the two outputs (or drops the pooler's
weights), which the same assertion refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference import converted, hf_noised

import specvit
from specvit.errors import SpecError

TEXT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40,
            max_position_embeddings=40)  # fmt: skip
IMAGE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40, image_size=32,
             patch_size=8)  # fmt: skip

CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "BertModel": ("BertConfig", "tokens", TEXT),
    "RobertaModel": ("RobertaConfig", "tokens", TEXT),
    "XLMRobertaModel": ("XLMRobertaConfig", "tokens", TEXT),
    "CamembertModel": ("CamembertConfig", "tokens", TEXT),
    "Data2VecTextModel": ("Data2VecTextConfig", "tokens", TEXT),
    "AlbertModel": ("AlbertConfig", "tokens", TEXT | {"embedding_size": 16}),
    "ViTModel": ("ViTConfig", "image", IMAGE),
    "ViTModel-wide": ("ViTConfig", "image", IMAGE | {"pooler_output_size": 24}),
    "DeiTModel": ("DeiTConfig", "image", IMAGE),
    "BeitModel": ("BeitConfig", "image", IMAGE | {"use_mean_pooling": True}),
    "BeitModel-cls": ("BeitConfig", "image", IMAGE | {"use_mean_pooling": False}),
    "Data2VecVisionModel": ("Data2VecVisionConfig", "image", IMAGE),
    "Dinov2Model": ("Dinov2Config", "image", {k: v for k, v in IMAGE.items() if k != "intermediate_size"}),
    "CLIPTextModel": ("CLIPTextConfig", "tokens", TEXT | {"eos_token_id": 59}),
    "CLIPVisionModel": ("CLIPVisionConfig", "image", IMAGE),
    "SiglipVisionModel": ("SiglipVisionConfig", "image", IMAGE),
}
KWARGS = {"Data2VecVisionModel": {"add_pooling_layer": True}}  # its default is without


def _reference(case: str) -> tuple[torch.nn.Module, str]:
    import transformers

    config_class, inputs, sizes = CASES[case]
    cls = case.split("-")[0]
    ref = hf_noised(cls, getattr(transformers, config_class)(**sizes), **KWARGS.get(cls, {}))
    return ref, inputs


def _inputs(kind: str) -> torch.Tensor:
    torch.manual_seed(1)
    if kind == "image":
        return torch.randn(2, 3, 32, 32)
    ids = torch.randint(3, 58, (2, 7))
    ids[0, 5], ids[1, 3] = 59, 59  # CLIP's end-of-text token, pooled
    return ids


def _gap(ours: Any, ref: torch.nn.Module, x: torch.Tensor) -> float:
    """The largest difference of the two outputs, each against HF's of the same name."""
    with torch.no_grad():
        want = ref(x)
    assert isinstance(ours, dict) and list(ours) == ["last_hidden_state", "pooler_output"]
    return max((ours[k] - want[k]).abs().max().item() for k in ours)


@pytest.mark.parametrize("case", list(CASES))
def test_a_base_model_with_its_pooler_returns_both_outputs(case: str) -> None:
    ref, kind = _reference(case)
    spec = specvit.from_hf(ref)
    assert spec.head.kind == "classifier" and spec.head.tokens and spec.head.classes is None
    model = converted(ref, spec)
    x = _inputs(kind)
    with torch.no_grad():
        out = model(x)
    assert _gap(out, ref, x) <= 1e-4
    swapped = {"last_hidden_state": out["pooler_output"], "pooler_output": out["last_hidden_state"]}
    with pytest.raises(RuntimeError):  # the control: the outputs swapped differ in shape from HF's
        _gap(swapped, ref, x)
    shifted = {k: v + 1e-3 for k, v in out.items()}
    assert _gap(shifted, ref, x) > 1e-4  # the control of the bound


@pytest.mark.parametrize("case", ["BertModel", "AlbertModel", "ViTModel", "BeitModel", "CLIPVisionModel",
                                  "SiglipVisionModel", "CLIPTextModel"])  # fmt: skip
def test_to_hf_writes_the_pooler_back(case: str, tmp_path: Path) -> None:
    import transformers

    ref, kind = _reference(case)
    model = converted(ref, specvit.from_hf(ref))
    specvit.to_hf(model, tmp_path)
    back = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(ref).__name__
    x = _inputs(kind)
    with torch.no_grad():
        out = model(x)
    assert _gap(out, back, x) <= 1e-5
    torch.nn.init.zeros_(next(p for n, p in back.named_parameters() if "pooler" in n or "head" in n
                              or "post_layernorm" in n or "final_layer_norm" in n))  # fmt: skip
    assert _gap(out, back, x) > 1e-4  # the control: the pooler's weight lost


@pytest.mark.parametrize("case", ["BertModel", "ViTModel", "BeitModel", "RobertaModel"])
def test_from_pretrained_reads_a_saved_base_model_with_its_pooler(case: str, tmp_path: Path) -> None:
    ref, kind = _reference(case)
    ref.save_pretrained(tmp_path)
    model = specvit.from_pretrained(tmp_path)
    x = _inputs(kind)
    with torch.no_grad():
        assert _gap(model(x), ref, x) <= 1e-4
    bare = specvit.from_hf(tmp_path / "config.json")  # the control: the config alone is the bare base class
    assert bare.head.kind == "none"


def test_a_pooler_without_weights_is_not_seen_in_a_checkpoint(tmp_path: Path) -> None:
    """BeitModel pooling its class token has a pooler of no weights: its saved directory cannot say it was
    built, and reads as the base class without it (from_hf of the model itself reads it)."""
    ref, kind = _reference("BeitModel-cls")
    ref.save_pretrained(tmp_path)
    model = specvit.from_pretrained(tmp_path)
    with torch.no_grad():
        out = model(_inputs(kind))
        assert (out - ref(_inputs(kind)).last_hidden_state).abs().max().item() <= 1e-4
    assert specvit.from_hf(ref).head.tokens  # the control: the model says it


def test_a_base_model_without_its_pooler_stays_headless() -> None:
    import transformers

    config = transformers.BertConfig(**TEXT)
    bare = hf_noised("BertModel", config, add_pooling_layer=False)
    spec = specvit.from_hf(bare)
    assert spec.head.kind == "none"
    x = _inputs("tokens")
    with torch.no_grad():
        assert (converted(bare, spec)(x) - bare(x).last_hidden_state).abs().max().item() <= 1e-4
    assert specvit.from_hf(config).head.kind == "none"  # a config alone: as before
    assert specvit.from_hf(config, pooler=True).head.tokens  # unless told


def test_pooler_true_reads_a_pooler_only_where_the_class_has_one() -> None:
    """ViTModel builds a pooler, ViTMSNModel none: the flag gives the first its pooler's head and changes
    nothing of the second."""
    import transformers

    spec = specvit.from_hf(dict(model_type="vit", **IMAGE), pooler=True)
    assert spec.head.tokens and [op.kind for op in spec.head.ops] == ["linear", "act"]

    msn = specvit.from_hf(transformers.ViTMSNConfig(**IMAGE).to_dict(), pooler=True)
    assert msn.head.kind == "none"  # ViTMSNModel builds no pooler: the flag changes nothing


def test_an_unknown_pooler_activation_is_refused() -> None:
    with pytest.raises(
        SpecError, match=r"config\.pooler_act: vit config has pooler_act='sigmoid': specvit has no"
    ):
        specvit.from_hf(dict(model_type="vit", pooler_act="sigmoid", **IMAGE), pooler=True)
    spec = specvit.from_hf(dict(model_type="vit", pooler_act="relu", **IMAGE), pooler=True)  # the control
    assert spec.head.ops[1].fn == "relu"
