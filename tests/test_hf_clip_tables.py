"""The towers of the CLIP layout as tables (specvit/interop/hf_clip.py): CLIP's text and vision towers with and
without their projections, SigLIP's vision tower with and without its attention-pooling head. From the config
a spec, from the state dict specvit's weights, and the same features as transformers (fp32, <= 1e-4, N(0, 0.08)
on every weight and buffer). Each field a table reads is switched in turn, HF's output moving and specvit's
following; an unknown field, and a value or class the spec cannot state, is refused with the field named."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from reference import check_refused, check_table_defaults, converted, hf_noised, noised, unswitched
from test_hf_tables import ATOL, NOISE
from torch import nn

import specvit
from specvit.convert import convert_state_dict
from specvit.interop.table import TABLES

VISION = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, image_size=32,
              patch_size=8)  # fmt: skip
TEXT = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=16, bos_token_id=0, pad_token_id=1, eos_token_id=50)  # fmt: skip
EOS = 50

# family -> (config class, [model classes], fields, [(field, another value[, the class it is switched in])])
CASES: dict[str, tuple[str, list[str], dict[str, Any], list[tuple[Any, ...]]]] = {
    "clip_vision_model": (
        "CLIPVisionConfig",
        ["CLIPVisionModel", "CLIPVisionModelWithProjection"],
        VISION | dict(projection_dim=11),
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("num_channels", 1), ("image_size", 40),
         ("patch_size", 4), ("projection_dim", 7, "CLIPVisionModelWithProjection")],
    ),
    "chinese_clip_vision_model": (
        "ChineseCLIPVisionConfig",
        ["ChineseCLIPVisionModel"],
        VISION,
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("num_channels", 1), ("image_size", 40),
         ("patch_size", 4)],
    ),
    "siglip_vision_model": (
        "SiglipVisionConfig",
        ["SiglipVisionModel"],
        VISION,
        [("layer_norm_eps", 0.3), ("hidden_act", "relu"), ("num_channels", 1), ("image_size", 40),
         ("patch_size", 4), ("vision_use_head", False)],
    ),
    "clip_text_model": (
        "CLIPTextConfig",
        ["CLIPTextModel", "CLIPTextModelWithProjection"],
        TEXT | dict(projection_dim=11),
        [("layer_norm_eps", 0.3), ("hidden_act", "gelu"), ("projection_dim", 7, "CLIPTextModelWithProjection"),
         ("eos_token_id", 2, "CLIPTextModelWithProjection")],  # the legacy rule: the highest id
    ),
}  # fmt: skip

POOLED = ("image_embeds", "text_embeds", "pooler_output")
"""What a class with a head returns, the first its output holds: a projection, else the pooled features; a
class without one (SigLIP's tower without its head) returns the tokens. A base model (CLIPTextModel,
CLIPVisionModel, SiglipVisionModel) returns its tokens beside its pooled features, as HF's (issue #25)."""
SHAPES = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
          "max_position_embeddings"}  # fmt: skip


def _hf(family: str, cls: str, seed: int = 0, **change: Any) -> nn.Module:
    import transformers

    config_name, _, kw, _ = CASES[family]
    return hf_noised(cls, getattr(transformers, config_name)(**(kw | change)), seed, NOISE)


def _tokens(eos: int) -> torch.Tensor:
    """Three rows of ids, each holding the end token (the first is pooled), or the highest id for eos 2."""
    ids = torch.randint(3, 90, (3, 12), generator=torch.Generator().manual_seed(2))
    ids[0, 6], ids[0, 9], ids[1, 11], ids[2, 3] = eos, eos, eos, eos
    if eos == 2:  # the legacy rule pools the highest id
        ids[0, 4], ids[1, 7], ids[2, 10] = 96, 96, 96
    return ids


def _outputs(ref: nn.Module, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's output (through from_hf(model) and the converter) and HF's, on the same input: images, or
    ids padded after the pooled token in one row and before it in another."""
    model = converted(ref, specvit.from_hf(ref))
    stack = model.spec.stacks["encoder"]
    with torch.no_grad():
        if stack.input.kind == "image":
            size = (stack.input.channels, *stack.input.size)
            images = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
            ours, out = model(images), ref(pixel_values=images)
        else:
            ids = _tokens(ref.config.eos_token_id)
            mask = torch.ones_like(ids)
            if padded:
                mask[1, 5:], mask[2, 2:] = 0, 0
            ours, out = model(ids, key_padding_mask=mask == 0), ref(input_ids=ids, attention_mask=mask)
    if isinstance(
        ours, dict
    ):  # a base model with its pooler: the tokens checked here, then the pooled features
        tokens, hf_tokens = ours["last_hidden_state"], out.last_hidden_state
        if stack.input.kind == "tokens":
            tokens, hf_tokens = tokens[mask.bool()], hf_tokens[mask.bool()]
        assert (tokens - hf_tokens).abs().max().item() <= ATOL
        ours = ours["pooler_output"]
    pooled = [getattr(out, k) for k in POOLED if getattr(out, k, None) is not None]
    theirs = out.last_hidden_state if model.spec.head.kind == "none" else pooled[0]
    if ours.ndim == 3 and stack.input.kind == "tokens":  # the tokens HF defines: the real ones
        keep = mask.bool()
        return ours[keep], theirs[keep]
    return ours, theirs


@pytest.mark.parametrize(("family", "cls"), [(f, c) for f, case in CASES.items() for c in case[1]])
def test_towers_are_transformers(family: str, cls: str) -> None:
    ref = _hf(family, cls)
    ours, theirs = _outputs(ref)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= ATOL
    if family == "clip_text_model":  # the control: the padding before row 2's end token changes it
        _, unpadded = _outputs(ref, padded=False)
        assert (unpadded[-1] - theirs[-1]).abs().max().item() > 10 * ATOL


@functools.cache
def _reference(family: str, cls: str) -> torch.Tensor:
    """HF's output of the family's case as it is, which each switched field must move (computed once)."""
    return _outputs(_hf(family, cls))[1]


@pytest.mark.parametrize(
    ("family", "field", "value", "cls"),
    [(f, k, v, (*c, case[1][0])[0]) for f, case in CASES.items() for k, v, *c in case[3]],
)
def test_each_field_a_table_reads_moves_the_output_as_in_transformers(
    family: str, field: str, value: Any, cls: str
) -> None:
    ours, theirs = _outputs(_hf(family, cls, **{field: value}))
    assert (ours - theirs).abs().max().item() <= ATOL
    before = _reference(family, cls)
    if before.shape == theirs.shape:  # the control: the field changes what HF computes
        assert (before - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("family", CASES)
def test_every_field_a_table_reads_is_switched(family: str) -> None:
    untested = unswitched(TABLES[family], {k for k, *_ in CASES[family][3]}, SHAPES, {"attention_dropout"})
    assert not untested, f"{family}: fields read but never switched: {untested}"


@pytest.mark.parametrize("family", CASES)
def test_table_defaults_are_the_config_class_defaults(family: str) -> None:
    check_table_defaults(TABLES[family], CASES[family][0], family)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model_type": "clip_vision_model", "clip_logits": 4.0},
         "config.clip_logits: clip_vision_model config has clip_logits=4.0: specvit's CLIPVision table"),
        ({"model_type": "siglip_vision_model", "architectures": ["SiglipForImageClassification"]},
         "config.architectures: siglip_vision_model config has architectures=['SiglipForImageClassification']: "
         "specvit reads the SiglipVision classes SiglipVisionModel"),
        ({"model_type": "clip_text_model", "eos_token_id": [2, 3]},
         "config.eos_token_id: clip_text_model config has eos_token_id=[2, 3]: expected an integer"),
        ({"model_type": "clip_text_model", "eos_token_id": -1},
         "config.eos_token_id: clip_text_model config has eos_token_id=-1: the pooled token must be a token id"),
        ({"model_type": "clip", "architectures": ["CLIPForImageClassification"]},
         "config.architectures: clip config has architectures=['CLIPForImageClassification']: specvit reads a "
         "CLIPModel's text tower"),
        ({"model_type": "clip", "clip_logits": 4.0}, "config.clip_logits: clip config has clip_logits=4.0"),
        ({"model_type": "clip", "text_config": {"hidden_act": "mish"}},
         "config.text_config.hidden_act: clip config has text_config.hidden_act='mish': specvit has no such"),
    ],
    ids=["unknown", "siglip_classifier", "eos_list", "eos_negative", "clip_classifier", "clip_unknown",
         "clip_text_act"],
)  # fmt: skip
def test_values_a_table_cannot_state_are_refused(values: dict[str, Any], message: str) -> None:
    check_refused({"model_type": values["model_type"]}, values, message)


def test_a_clip_models_state_dict_loads_either_tower() -> None:
    """A CLIPModel's keys name both towers: a text spec takes the text tower, a vision spec the image tower
    (the text table is tried first and does not fit it), each with its projection."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=13)
    torch.manual_seed(0)
    ref = noised(CLIPModel(config), 0, NOISE)
    text = specvit.from_hf(config)
    vision_config = config.vision_config.to_dict() | {"projection_dim": 13}
    vision = specvit.from_hf(vision_config | {"architectures": ["CLIPVisionModelWithProjection"]})
    assert (text.head.classes, vision.head.classes) == (13, 13)
    ids, images = _tokens(EOS), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.get_text_features(input_ids=ids), ref.get_image_features(pixel_values=images)
        got = converted(ref, text)(ids), converted(ref, vision)(images)
    for w, g in zip(want, got, strict=True):
        w = w if isinstance(w, torch.Tensor) else w.pooler_output
        assert (w - g).abs().max().item() <= ATOL
    bare = specvit.from_hf(vision_config | {"architectures": ["CLIPVisionModel"]})
    with pytest.raises(ValueError, match=r"unexpected source keys \(1\): visual_projection\.weight"):
        convert_state_dict(ref.state_dict(), "hf", bare)  # the control: a tower without the projection
