"""The ViT-like vision towers as tables (specvit/interop/hf_vit.py, hf_beit.py): ViT, DeiT, DINOv2, Data2Vec-vision
and BEiT from their configs, their weights through the converter, the same features and logits as transformers (fp32, <= 1e-4, N(0, 0.08)
on every weight). Each field a table reads is switched in turn, HF's output moving and specvit's following."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from reference import check_refused, check_table_defaults, converted, noised, unswitched
from test_hf_tables import ATOL, NOISE
from torch import nn

import specvit
from specvit.interop.table import TABLES

SMALL = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)

BEIT = dict(intermediate_size=40, num_labels=5, use_absolute_position_embeddings=True)
BEIT_SWITCHES = [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("patch_size", 4), ("image_size", 40),
                 ("num_channels", 1), ("layer_scale_init_value", 0.5), ("layer_scale_init_value", 0.0),
                 ("use_absolute_position_embeddings", False), ("use_relative_position_bias", True),
                 ("use_shared_relative_position_bias", True), ("use_mean_pooling", False),
                 ("use_mean_pooling", False, 1), ("use_mean_pooling", False, 2)]  # fmt: skip
"""A table per layer, or one shared; absolute positions or none; the mean of the patches and its norm, or the
class token after a final norm (the classifier's, index 1 of the classes; the base model's pooler's, index 2)."""

# family -> (config class, [model classes], fields beyond SMALL, [(field, another value[, the index of the class
# switched])])
CASES: dict[str, tuple[str, list[str], dict[str, Any], list[tuple[str, Any]]]] = {
    "vit": (
        "ViTConfig",
        ["ViTModel", "ViTForImageClassification", "ViTModel+pooler"],
        dict(intermediate_size=40, num_labels=5),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("qkv_bias", False), ("num_channels", 1),
         ("image_size", 40), ("patch_size", 4), ("intermediate_size", 24), ("pooler_output_size", 24, 2),
         ("pooler_act", "relu", 2)],
    ),
    "vit_msn": (
        "ViTMSNConfig",
        ["ViTMSNModel", "ViTMSNForImageClassification"],
        dict(intermediate_size=40, num_labels=5),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("qkv_bias", False), ("num_channels", 1),
         ("image_size", 40), ("patch_size", 4)],
    ),
    "deit": (
        "DeiTConfig",
        ["DeiTModel", "DeiTForImageClassification", "DeiTForImageClassificationWithTeacher", "DeiTModel+pooler"],
        dict(intermediate_size=40, num_labels=5),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("qkv_bias", False), ("patch_size", 4),
         ("image_size", 40), ("num_channels", 1), ("pooler_output_size", 24, 3), ("pooler_act", "relu", 3)],
    ),
    "dinov2": (
        "Dinov2Config",
        ["Dinov2Model", "Dinov2ForImageClassification"],
        dict(),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("qkv_bias", False), ("mlp_ratio", 2),
         ("patch_size", 4), ("layerscale_value", 0.5), ("image_size", 40), ("num_channels", 1)],
    ),
    "data2vec-vision": (
        "Data2VecVisionConfig",
        ["Data2VecVisionModel", "Data2VecVisionForImageClassification", "Data2VecVisionModel+pooler"],
        BEIT,
        BEIT_SWITCHES,
    ),
    "beit": ("BeitConfig", ["BeitModel", "BeitForImageClassification", "BeitModel+pooler"], BEIT, BEIT_SWITCHES),
}  # fmt: skip


def _hf(family: str, cls: str, seed: int = 0, **change: Any) -> nn.Module:
    import transformers

    config_name, _, kw, _ = CASES[family]
    config = getattr(transformers, config_name)(**(SMALL | kw | change))
    torch.manual_seed(seed)
    if cls.endswith("+pooler"):  # a base model with its pooler (Data2VecVisionModel's default is without)
        ref = getattr(transformers, cls.removesuffix("+pooler"))(config, add_pooling_layer=True)
    elif cls.endswith("Model") and family not in ("dinov2", "vit_msn"):  # classes without a pooler
        ref = getattr(transformers, cls)(config, add_pooling_layer=False)
    else:
        ref = getattr(transformers, cls)(config)
    return noised(ref, seed, NOISE)


def _outputs(ref: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's output (through from_hf(model) and the converter) and HF's, on the same images."""
    model = converted(ref, specvit.from_hf(ref))
    spec = model.spec.stacks["encoder"].input
    images = torch.randn(2, spec.channels, *spec.size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, ours = ref(pixel_values=images), model(images)
    if isinstance(ours, dict):  # a base model with its pooler (DINOv2's always): the tokens checked here
        assert (ours["last_hidden_state"] - theirs.last_hidden_state).abs().max().item() <= ATOL
        return ours["pooler_output"], theirs.pooler_output
    return ours, theirs.logits if hasattr(theirs, "logits") else theirs.last_hidden_state


@pytest.mark.parametrize(("family", "cls"), [(f, c) for f, case in CASES.items() for c in case[1]])
def test_towers_and_classifiers_are_transformers(family: str, cls: str) -> None:
    ours, theirs = _outputs(_hf(family, cls))
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= ATOL


@functools.cache
def _reference(family: str, cls: str) -> torch.Tensor:
    """HF's output of the family's case as it is, which each switched field must move (computed once)."""
    return _outputs(_hf(family, cls))[1]


@pytest.mark.parametrize(
    ("family", "field", "value", "index"),
    [(f, k, v, (*i, 0)[0]) for f, case in CASES.items() for k, v, *i in case[3]],
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any, index: int
) -> None:
    cls = CASES[family][1][index]
    ours, theirs = _outputs(_hf(family, cls, **{field: value}))
    assert (ours - theirs).abs().max().item() <= ATOL
    before = _reference(family, cls)
    if before.shape == theirs.shape:  # the control: the field changes what HF computes
        assert (before - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched(family: str) -> None:
    shapes = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "id2label"}
    training = {"attention_probs_dropout_prob", "drop_path_rate"}
    untested = unswitched(TABLES[family], {k for k, *_ in CASES[family][3]}, shapes, training)
    assert not untested, f"{family}: fields read but never switched: {untested}"


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    check_table_defaults(TABLES[family], CASES[family][0], family, whole=False)


def test_legacy_names_load_the_same_model() -> None:
    """transformers 4 and Hub checkpoints name ViT's layers ``encoder.layer.{i}.attention.attention.query``."""
    ref = _hf("vit", "ViTModel")
    legacy = {}
    renames = {"attention.q_proj": "attention.attention.query", "attention.k_proj": "attention.attention.key",
               "attention.v_proj": "attention.attention.value", "attention.o_proj": "attention.output.dense",
               "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}  # fmt: skip
    for key, value in ref.state_dict().items():
        if key.startswith("layers."):
            key = "encoder.layer." + key.removeprefix("layers.")
            for new, old in renames.items():
                key = key.replace(f".{new}.", f".{old}.")
        legacy[key] = value
    spec = specvit.from_hf(ref)
    a = specvit.convert_state_dict(ref.state_dict(), "hf", spec)
    b = specvit.convert_state_dict(legacy, "hf", spec)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("dinov2", {"use_swiglu_ffn": True}, "config.use_swiglu_ffn: dinov2 config has use_swiglu_ffn=True"),
        (
            "vit",
            {"hidden_dropout_prob": 0.1},
            "config.hidden_dropout_prob: vit config has hidden_dropout_prob=0.1",
        ),
        ("vit", {"architectures": ["ViTForMaskedImageModeling"]}, "config.architectures: vit config has"),
        (
            "deit",
            {"layerscale": 1.0},
            "config.layerscale: deit config has layerscale=1.0: specvit's DeiT table",
        ),
        (
            "data2vec-vision",
            {"use_relative_position_bias": True, "use_shared_relative_position_bias": True},
            "config.use_relative_position_bias: data2vec-vision config has use_relative_position_bias=True: a "
            "table per layer added to the shared one",
        ),
        ("beit", {"architectures": ["BeitForMaskedImageModeling"]}, "config.architectures: beit config has"),
        (
            "dinov2",
            {"architectures": ["Dinov2Backbone"]},  # feature maps of chosen stages
            "config.architectures: dinov2 config has architectures=['Dinov2Backbone']: specvit "
            "reads the Dinov2 classes Dinov2Model, Dinov2ForImageClassification",
        ),
        (
            "beit",
            {"image_size": [32, 48]},
            "config.image_size: beit config has image_size=[32, 48]: expected an",
        ),
        (
            "data2vec-vision",
            {"hidden_dropout_prob": 0.1},
            "config.hidden_dropout_prob: data2vec-vision config has hidden_dropout_prob=0.1: BEiT's dropout",
        ),
    ],
)
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    check_refused(_hf(family, CASES[family][1][0]).config.to_dict(), change, message)


def test_a_beit_model_with_its_pooler_is_refused_by_the_converter() -> None:
    """BeitModel builds its pooler (the mean's norm) unless told not to: the base model's head is none, so the
    pooler's weights are named, not dropped; its classifier reads them."""
    import transformers

    config = transformers.BeitConfig(**(SMALL | BEIT))
    spec = specvit.from_hf(config.to_dict() | {"architectures": ["BeitModel"]})
    with pytest.raises(ValueError, match=r"unexpected source keys \(2\): pooler\.layernorm\.weight"):
        specvit.convert_state_dict(transformers.BeitModel(config).state_dict(), "hf", spec)
    specvit.convert_state_dict(
        transformers.BeitModel(config, add_pooling_layer=False).state_dict(), "hf", spec
    )


def test_beits_hub_names_are_data2vec_visions() -> None:
    """BEiT checkpoints hold transformers 4's names, Data2Vec-vision's layout under ``beit.``: they load into
    the spec of the BEiT config and compute what Data2Vec-vision computes."""
    ref = _hf("data2vec-vision", "Data2VecVisionForImageClassification")
    legacy = {k.replace("data2vec_vision.", "beit."): v for k, v in ref.state_dict().items()}
    config = ref.config.to_dict() | {"model_type": "beit", "architectures": ["BeitForImageClassification"]}
    model = specvit.build_model(specvit.from_hf(config)).eval()
    model.load_state_dict(specvit.convert_state_dict(legacy, "hf", model.spec), strict=True)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(images) - ref(pixel_values=images).logits).abs().max().item() <= ATOL
