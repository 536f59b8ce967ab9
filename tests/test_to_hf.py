"""Back to transformers (``specvit.to_hf``): a spec that is exactly an HF family is written as config.json +
model.safetensors, and transformers' own class loads it with the same outputs. A spec no family states is
refused with the keys that differ from the closest family, and nothing is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from reference import converted
from test_hf_encoder_tables import GLOBAL_FIRST, THETAS
from test_hf_tables import ATOL, _hf, _tokens

import specvit
from specvit.errors import SpecError
from specvit.interop.to_hf import hf_config

ROOT = Path(__file__).resolve().parents[1]


def _load(directory: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(_tokens())
    return out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "mixtral", "phi3", "olmo2"])
def test_an_imported_model_goes_back_to_its_family(family: str, tmp_path: Path) -> None:
    """HF -> specvit -> HF: the class transformers loads from specvit's directory is the original's, with the
    original's outputs; a weight changed in specvit comes back changed (the control)."""
    ref = _hf(family)
    ours = converted(ref, specvit.from_hf(ref.config))
    specvit.to_hf(ours, tmp_path / "back")
    back = _load(tmp_path / "back")
    assert type(back) is type(ref)
    assert (_logits(back) - _logits(ref)).abs().max().item() <= 1e-5
    assert (_logits(back) - _logits(ours)).abs().max().item() <= ATOL

    with torch.no_grad():
        ours.decoder.blocks[1].attn.proj.weight.add_(0.05)
    specvit.to_hf(ours, tmp_path / "changed")
    assert (_logits(_load(tmp_path / "changed")) - _logits(ref)).abs().max().item() > 10 * ATOL


def test_a_written_spec_finds_its_family(tmp_path: Path) -> None:
    """docs/examples/qwen2_tiny.yaml, written by hand, is Qwen2: the directory loads as Qwen2ForCausalLM."""
    spec = specvit.load_spec(ROOT / "docs" / "examples" / "qwen2_tiny.yaml")
    table, config = hf_config(spec)
    assert (table.name, config["architectures"]) == ("Qwen2", ["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    ours = specvit.build_model(spec).eval()
    back = _load(specvit.to_hf(ours, tmp_path / "qwen2"))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(ids).logits - ours(ids)).abs().max().item() <= ATOL


def test_sliding_windows_of_some_layers_become_layer_types() -> None:
    spec = specvit.from_hf(_hf("qwen2").config)
    _, config = hf_config(spec)
    assert config["layer_types"] == ["full_attention", "sliding_attention"]
    assert (config["sliding_window"], config["use_sliding_window"]) == (5, True)


@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        (
            "qwen2",
            {"decoder.dropout.projection": 0.1},
            "the closest, HF Qwen2ForCausalLM, differs: decoder.dropout.projection is 0.1 in the spec, 0.0 in HF's",
        ),
        (
            "qwen2",
            {"decoder.block.norm.kind": "layernorm"},
            "decoder.block.norm.kind is 'layernorm' in the spec, 'rmsnorm' in HF's",
        ),
        (
            "electra",  # its own family is named, not one whose table refuses the spec at its first key
            {"encoder.block.mlp.bias": False, "encoder.block.proj_bias": False},
            "the closest, HF ElectraForMaskedLM, differs: encoder.block.mlp.bias is False in the spec, True in HF's",
        ),
        (
            "vit_mae",
            {},
            "spec 'vit_mae_from_hf' is no HF model class specvit's tables state (HF ViTMAEForPreTraining is read by a "
            "converter that is no table, so cannot run backwards)",
        ),
        (
            "swin_tiny_patch4_window7_224",  # (timm's ViT presets are HF's ViT: their square size is one integer)
            {},
            "spec 'swin_tiny_patch4_window7_224' is no HF model class specvit's tables state",
        ),
    ],
)
def test_a_spec_no_family_states_is_refused_and_nothing_written(
    source: str, overrides: dict[str, object], message: str, tmp_path: Path
) -> None:
    if source in ("qwen2", "electra"):
        ref = _hf(source) if source == "qwen2" else _case(source, "ForMaskedLM")[0]
        spec = specvit.from_hf(ref.config.to_dict() | {"architectures": [type(ref).__name__]})
    elif source == "vit_mae":
        sizes = dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=40, image_size=32
        )
        spec = specvit.from_hf({"model_type": source, "patch_size": 8, "decoder_hidden_size": 16} | sizes)
    else:
        spec = specvit.load_spec(source)
    spec = specvit.load_spec(spec, overrides=overrides) if overrides else spec
    model = specvit.build_model(spec, device="meta")
    with pytest.raises(SpecError) as info:
        specvit.to_hf(model, tmp_path / "out")
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()


def test_transformers_is_named_when_it_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """to_hf reads the class's weights' names from transformers: without it, it says what to install (from_hf
    reads configs without it) and writes nothing."""
    spec = specvit.load_spec(ROOT / "docs" / "examples" / "qwen2_tiny.yaml")
    model = specvit.build_model(spec, device="meta")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert specvit.from_hf({"model_type": "qwen2"}).model == "decoder"
    with pytest.raises(SpecError, match=r"to_hf needs transformers \(pip install transformers\)"):
        specvit.to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _case(family: str, cls: str | None, **change: object) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The test case of another test file: HF's class of the family with ``change`` in its config, and its input."""
    import test_hf_clip_tables as clip
    import test_hf_decoder_tables2 as decoders
    import test_hf_encoder_tables as encoders
    import test_hf_vision_tables as towers

    if family in encoders.CASES:
        return encoders._hf(family, cls, **change), {"input_ids": _tokens()[:, :12]}
    if family == "clip_text_model":
        return clip._hf(family, str(cls), **change), {"input_ids": clip._tokens(clip.EOS)}
    if family in towers.CASES or family in clip.CASES:
        ref = (towers if family in towers.CASES else clip)._hf(family, str(cls), **change)
        size = ref.config.image_size
        images = torch.randn(
            2, ref.config.num_channels, size, size, generator=torch.Generator().manual_seed(1)
        )
        return ref, {"pixel_values": images}
    return decoders._hf(family, **change), {"input_ids": _tokens()}


def _output(model: torch.nn.Module, x: dict[str, torch.Tensor], pooled: bool = True) -> torch.Tensor:
    """The logits, else the projected, pooled (unless not ``pooled``) or last features of ``model`` on ``x``."""
    with torch.no_grad():
        out = model.eval()(**x)
    if getattr(out, "start_logits", None) is not None:  # question answering: specvit's (B, N, 2)
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    names = (
        "logits",
        "image_embeds",
        "text_embeds",
        *(("pooler_output",) if pooled else ()),
        "last_hidden_state",
    )
    return getattr(out, next(n for n in names if getattr(out, n, None) is not None))


def _written_back(ref: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """HF -> specvit -> HF: the class config.json names, loaded from the directory to_hf wrote."""
    import transformers

    ours = converted(ref, specvit.from_hf(ref.config.to_dict() | {"architectures": [type(ref).__name__]}))
    config = json.loads((specvit.to_hf(ours, directory) / "config.json").read_text())
    back = getattr(transformers, config["architectures"][0]).from_pretrained(directory).eval()
    assert type(back) is type(ref)
    return back


@pytest.mark.parametrize(
    ("family", "cls"),
    [("bert", "ForMaskedLM"), ("roberta", "ForSequenceClassification"), ("xlm-roberta", "ForTokenClassification"),
     ("distilbert", "Model"), ("vit", "ViTForImageClassification"), ("deit", "DeiTForImageClassificationWithTeacher"),
     ("gpt2", "GPT2LMHeadModel"), ("mpt", "MptForCausalLM"), ("stablelm", "StableLmForCausalLM"),
     ("gptj", "GPTJForCausalLM"), ("opt", "OPTForCausalLM"), ("falcon", "FalconForCausalLM"),
     ("electra", "ForMaskedLM"), ("electra", "ForQuestionAnswering"), ("albert", "ForMaskedLM"), ("modernbert", "ForMaskedLM"),
     ("dinov2", "Dinov2ForImageClassification"), ("beit", "BeitForImageClassification"),
     ("data2vec-vision", "Data2VecVisionModel"), ("clip_vision_model", "CLIPVisionModelWithProjection"),
     ("siglip_vision_model", "SiglipVisionModel"), ("clip_text_model", "CLIPTextModel"),
     ("clip_text_model", "CLIPTextModelWithProjection")],
)  # fmt: skip
def test_encoders_towers_and_decoders_go_back(family: str, cls: str, tmp_path: Path) -> None:
    """HF -> specvit -> HF for the other layouts: the class named in config.json is the original's, with its
    outputs (padding ids write pad_token_id back, RoBERTa's offset too, a square image its one size)."""
    ref, x = _case(family, cls)
    back = _written_back(ref, tmp_path / "back")
    pooled = (
        cls != "CLIPTextModel"
    )  # whose pooler_output, no part of a spec without a head, reads eos_token_id
    assert (_output(back, x, pooled) - _output(ref, x, pooled)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("family", "cls", "change"),
    [("gptj", None, {"rotary_dim": 16}), ("opt", None, {"do_layer_norm_before": False}),
     ("opt", None, {"_remove_final_layer_norm": True}),
     ("falcon", None, {"new_decoder_architecture": True, "num_kv_heads": 2}),
     ("falcon", None, {"multi_query": False, "parallel_attn": False}),
     ("falcon", None, {"rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}),
     ("electra", "ForMaskedLM", {"embedding_size": 48}), ("albert", "ForTokenClassification", {"num_hidden_groups": 4}),
     ("modernbert", "ForTokenClassification", {"local_attention": 4, "layer_types": GLOBAL_FIRST, "rope_parameters": THETAS}),
     ("dinov2", "Dinov2Model", {"mlp_ratio": 2}),
     ("beit", "BeitForImageClassification", {"use_mean_pooling": False, "use_shared_relative_position_bias": True}),
     ("data2vec-vision", "Data2VecVisionModel",
      {"use_absolute_position_embeddings": False, "use_relative_position_bias": True, "layer_scale_init_value": 0.0}),
     ("siglip_vision_model", "SiglipVisionModel", {"vision_use_head": False}),
     ("clip_text_model", "CLIPTextModelWithProjection", {"eos_token_id": 2})],
)  # fmt: skip
def test_the_fields_a_table_reads_are_written_back(
    family: str, cls: str | None, change: dict[str, object], tmp_path: Path
) -> None:
    """Each switched field reaches config.json and the reloaded class computes the switched model (Falcon's
    key/value groups put back in its fused projection's order, ELECTRA's embeddings as wide as its blocks, an
    ALBERT group a layer, ModernBERT's local layers, their window and both thetas, BEiT's positions and pooling, SigLIP without its
    head, CLIP text's legacy pooling at the highest id); the control: the switch moves HF's output."""
    ref, x = _case(family, cls, **change)
    back = _written_back(ref, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: written[k] for k in change} == change
    want = _output(ref, x)
    assert (_output(back, x) - want).abs().max().item() <= 1e-5
    before = _output(_case(family, cls)[0], x)
    assert before.shape != want.shape or (before - want).abs().max().item() > 10 * ATOL


def test_two_norms_of_one_hf_weight_must_be_equal(tmp_path: Path) -> None:
    """Falcon-7B's blocks feed one norm to both branches, specvit's two norms holding its weight: after they
    part (a fine-tuned norm2), the directory is refused, not written with one of them."""
    import test_hf_decoder_tables2 as decoders

    ref = decoders._hf("falcon")
    ours = converted(ref, specvit.from_hf(ref.config))
    specvit.to_hf(ours, tmp_path / "same")  # the control: equal norms are written
    with torch.no_grad():
        ours.decoder.blocks[0].norm2.weight.add_(0.05)
    with pytest.raises(SpecError, match=r"HF Falcon has one weight transformer\.h\.0\.input_layernorm\.weight "
                                        r"where the spec has two, and they differ"):  # fmt: skip
        specvit.to_hf(ours, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("family", "cls", "pooler"),
    [("albert", "Model", "pooler.bias, pooler.weight"), ("beit", "BeitModel", "pooler.layernorm.bias")],
)
def test_a_base_model_whose_class_builds_a_pooler_is_refused(
    family: str, cls: str, pooler: str, tmp_path: Path
) -> None:
    """AlbertModel and BeitModel build a pooler unless add_pooling_layer=False is passed to them, which no
    config says: a spec of the base model without it is refused with the pooler named; the control: the
    class whose head reads the pooler goes back."""
    ref, _ = _case(family, cls)
    ours = converted(ref, specvit.from_hf(ref.config.to_dict() | {"architectures": [type(ref).__name__]}))
    with pytest.raises(SpecError) as info:
        specvit.to_hf(ours, tmp_path / "out")
    assert f"builds a pooler ({pooler}" in str(info.value)
    assert "add_pooling_layer=False is passed to it, which a config cannot say" in str(info.value)
    assert "give the spec the pooler's head (from_hf of the model built with its pooler" in str(info.value)
    assert not (tmp_path / "out").exists()
    classifier = "ForSequenceClassification" if family == "albert" else "BeitForImageClassification"
    _written_back(_case(family, classifier)[0], tmp_path / "classifier")
