"""The ViT-like vision towers as tables (specvit/interop/hf_vit.py): ViT, DeiT and DINOv2 from their configs,
their weights through the converter, the same features and logits as transformers (fp32, <= 1e-4, N(0, 0.08)
on every weight). Each field a table reads is switched in turn, HF's output moving and specvit's following."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import converted, noised
from test_hf_tables import ATOL, NOISE
from torch import nn

import specvit
from specvit.errors import SpecError
from specvit.interop.table import COMMON, TABLES, F

SMALL = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)

# family -> (config class, [model classes], fields beyond SMALL, [(field, another value)])
CASES: dict[str, tuple[str, list[str], dict[str, Any], list[tuple[str, Any]]]] = {
    "vit": (
        "ViTConfig",
        ["ViTModel", "ViTForImageClassification"],
        dict(intermediate_size=40, num_labels=5),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("qkv_bias", False), ("num_channels", 1),
         ("image_size", 40), ("patch_size", 4), ("intermediate_size", 24)],
    ),
    "deit": (
        "DeiTConfig",
        ["DeiTModel", "DeiTForImageClassification", "DeiTForImageClassificationWithTeacher"],
        dict(intermediate_size=40, num_labels=5),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("qkv_bias", False), ("patch_size", 4),
         ("image_size", 40), ("num_channels", 1)],
    ),
    "dinov2": (
        "Dinov2Config",
        ["Dinov2Model"],
        dict(),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("qkv_bias", False), ("mlp_ratio", 2),
         ("patch_size", 4), ("layerscale_value", 0.5), ("image_size", 40), ("num_channels", 1)],
    ),
}  # fmt: skip


def _hf(family: str, cls: str, seed: int = 0, **change: Any) -> nn.Module:
    import transformers

    config_name, _, kw, _ = CASES[family]
    config = getattr(transformers, config_name)(**(SMALL | kw | change))
    torch.manual_seed(seed)
    if cls.endswith("Model") and family != "dinov2":
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
        theirs = ref(pixel_values=images)
        return model(images), theirs.logits if hasattr(theirs, "logits") else theirs.last_hidden_state


@pytest.mark.parametrize(("family", "cls"), [(f, c) for f, case in CASES.items() for c in case[1]])
def test_towers_and_classifiers_are_transformers(family: str, cls: str) -> None:
    ours, theirs = _outputs(_hf(family, cls))
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= ATOL


@pytest.mark.parametrize(
    ("family", "field", "value"), [(f, k, v) for f, case in CASES.items() for k, v in case[3]]
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any
) -> None:
    cls = CASES[family][1][0]
    ours, theirs = _outputs(_hf(family, cls, **{field: value}))
    assert (ours - theirs).abs().max().item() <= ATOL
    _, before = _outputs(_hf(family, cls))
    if before.shape == theirs.shape:  # the control: the field changes what HF computes
        assert (before - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched(family: str) -> None:
    table = TABLES[family]
    fields = table.fields()
    shapes = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "id2label"}
    untested = fields - {k for k, _ in CASES[family][3]} - shapes - COMMON - {"attention_probs_dropout_prob"}
    assert not untested, f"{family}: fields read but never switched: {sorted(untested)}"


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    import transformers

    defaults = getattr(transformers, CASES[family][0])()
    table = TABLES[family]
    entries = table.entries()
    for key, value in entries.items():
        if isinstance(value, F) and value.default is not None and hasattr(defaults, value.name):
            assert value.default == getattr(defaults, value.name), (family, key, value.name)


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
    ],
)
def test_values_a_table_cannot_state_are_refused(family: str, change: dict[str, Any], message: str) -> None:
    config = _hf(family, CASES[family][1][0]).config.to_dict()
    specvit.from_hf(config)  # the control
    with pytest.raises(SpecError, match=message.replace(".", r"\.").replace("(", r"\(")):
        specvit.from_hf(config | change)
