"""BART and CLIP's text tower imported from HF configs: exact parity with transformers, and refusals.

Each reference is built from a config with random weights moved away from their init (N(0, 0.1) noise on
every parameter, so that no zero bias or unit norm hides a wrong mapping), converted with
``convert_state_dict(..., "hf", spec)`` into the model built from ``from_hf(config)``, loaded with
``strict=True``, and run in fp32 on CPU: the largest absolute difference must be at most 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import converted, perturbed
from torch import Tensor
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    CLIPConfig,
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
)

from specvit.convert import convert_state_dict
from specvit.errors import SpecError
from specvit.interop.hf import from_hf, spec_dict
from specvit.spec.loader import parse_spec

TOL = 1e-5


# -- BART ---------------------------------------------------------------------------------------------

BART_SIZES: dict[str, dict[str, Any]] = {
    # head_dim 12, different encoder and decoder depths, heads and MLPs; tied, shared embeddings
    "tied": dict(
        d_model=24,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=4,
        encoder_ffn_dim=40,
        decoder_ffn_dim=36,
    ),
    # head_dim 7, scaled embeddings, gelu_new, three separate token tables (untied)
    "odd_untied": dict(
        d_model=21,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        encoder_ffn_dim=19,
        decoder_ffn_dim=33,
        scale_embedding=True,
        activation_function="gelu_new",
        tie_word_embeddings=False,
    ),
    # head_dim 10 (5 heads), relu, a pad token other than BART's
    "relu": dict(
        d_model=50,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=5,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=48,
        activation_function="relu",
        pad_token_id=0,
    ),
}


def _bart(size: str, seed: int = 0) -> BartForConditionalGeneration:
    torch.manual_seed(seed)
    config = BartConfig(vocab_size=97, max_position_embeddings=24, **BART_SIZES[size])
    return perturbed(BartForConditionalGeneration(config), seed)


def _bart_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(3, 97, (3, 13), generator=gen)
    tgt = torch.randint(3, 97, (3, 9), generator=gen)
    src_mask = torch.ones(3, 13, dtype=torch.long)
    src_mask[1, 9:] = 0
    src_mask[2, 4:] = 0
    tgt_mask = torch.ones(3, 9, dtype=torch.long)
    tgt_mask[2, 6:] = 0  # trailing padding: every query still sees a key
    return src, tgt, src_mask, tgt_mask


@pytest.mark.parametrize("size", sorted(BART_SIZES))
def test_bart_parity(size: str) -> None:
    ref = _bart(size)
    spec = from_hf(ref.config)
    model = converted(ref, spec)
    src, tgt, src_mask, tgt_mask = _bart_inputs()
    with torch.no_grad():
        plain = ref(input_ids=src, decoder_input_ids=tgt).logits
        assert (plain - model(src, tgt)).abs().max().item() <= TOL
        masked = ref(
            input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask
        ).logits
        ours = model(src, tgt, src_key_padding_mask=src_mask == 0, tgt_key_padding_mask=tgt_mask == 0)
    assert (masked - ours).abs().max().item() <= TOL
    assert (masked - plain).abs().max().item() > 1e-3  # the masks matter


def test_bart_spec_states_the_config() -> None:
    spec = from_hf(_bart("odd_untied").config)
    assert spec.encoder.depth == 1 and spec.decoder.depth == 2
    assert spec.encoder.input.scale and not spec.shared_embeddings and not spec.head.tied
    assert spec.encoder.position.offset == 2 and spec.encoder.position.max_len == 24
    assert spec.encoder.block.norm.placement == "post" and not spec.encoder.final_norm
    assert spec.encoder.embed_norm and spec.decoder.embed_norm
    assert spec.decoder.block.mlp.activation == "gelu_tanh" and spec.decoder.block.mlp.hidden == 33
    assert from_hf(_bart("relu").config).encoder.input.padding_idx == 0


def test_bart_nonzero_final_logits_bias_is_refused_or_carried() -> None:
    ref = _bart("tied")
    with torch.no_grad():
        ref.final_logits_bias.normal_()
    data = spec_dict(ref.config)
    data["head"]["bias"] = False  # a spec without a head bias (bart_base.yaml) has no place for it
    with pytest.raises(
        ValueError,
        match=r"nonzero buffers the spec has no place for \(1\): final_logits_bias \(write head.bias: true",
    ):
        convert_state_dict(ref.state_dict(), "hf", parse_spec(data, source="bart without a logits bias"))
    spec = from_hf(ref.config)  # the table carries it: the LM head's bias
    assert spec.head.bias
    model = converted(ref, spec)
    src, tgt, src_mask, _ = _bart_inputs()
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
        got = model(src, tgt, src_key_padding_mask=src_mask == 0)
    assert (want - got).abs().max().item() <= TOL


def test_bart_tied_copies_must_agree() -> None:
    ref = _bart("tied")
    state = dict(ref.state_dict())
    state["model.decoder.embed_tokens.weight"] = state["model.decoder.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match=r"decoder\.embed_tokens\.weight differs"):
        convert_state_dict(state, "hf", from_hf(ref.config))


# -- CLIP's text tower --------------------------------------------------------------------------------

CLIP_SIZES: dict[str, dict[str, Any]] = {
    # head_dim 12, eos_token_id 50 (the first occurrence is pooled)
    "eos": dict(hidden_size=24, num_attention_heads=2, intermediate_size=40, eos_token_id=50),
    # head_dim 7, HF's legacy eos_token_id 2 (the highest id is pooled), exact gelu
    "legacy_odd": dict(
        hidden_size=21, num_attention_heads=3, intermediate_size=30, eos_token_id=2, hidden_act="gelu"
    ),
    # head_dim 9, three blocks
    "deeper": dict(
        hidden_size=36, num_attention_heads=4, intermediate_size=52, num_hidden_layers=3, eos_token_id=96
    ),
}


def _clip_config(size: str) -> CLIPTextConfig:
    values = {"num_hidden_layers": 2, **CLIP_SIZES[size]}
    return CLIPTextConfig(
        vocab_size=97, max_position_embeddings=16, projection_dim=11, bos_token_id=0, pad_token_id=1, **values
    )


def _clip_tokens(eos: int) -> Tensor:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 90, (3, 12), generator=gen)
    ids[0, 6], ids[0, 9] = eos, eos  # the pooled token is the first eos (or the highest id)
    ids[1, 11] = eos
    ids[2, 3] = eos
    if eos == 2:  # the legacy rule pools the highest id
        ids[0, 4], ids[1, 7], ids[2, 10] = 96, 96, 96
    return ids


@pytest.mark.parametrize("size", sorted(CLIP_SIZES))
def test_clip_text_parity(size: str) -> None:
    config = _clip_config(size)
    torch.manual_seed(0)
    ref = perturbed(CLIPTextModelWithProjection(config), 0)
    spec = from_hf(config)
    model = converted(ref, spec)
    ids = _clip_tokens(config.eos_token_id)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padding after the pooled token changes nothing (causal); before it, it does
    mask[2, 2:] = 0
    with torch.no_grad():
        plain = ref(input_ids=ids).text_embeds
        assert (plain - model(ids)).abs().max().item() <= TOL
        masked = ref(input_ids=ids, attention_mask=mask).text_embeds
        ours = model(ids, key_padding_mask=mask == 0)
    assert (masked - ours).abs().max().item() <= TOL
    assert (masked - plain).abs().max().item() > 1e-3


def test_clip_eos_rule() -> None:
    assert from_hf(_clip_config("eos")).head.eos_id == 50
    assert from_hf(_clip_config("legacy_odd")).head.eos_id is None
    spec = from_hf(_clip_config("legacy_odd"))
    assert spec.encoder.block.layers[0] == "masked_self_attention" and spec.encoder.final_norm
    assert spec.head.classes == 11 and not spec.head.bias


def test_clip_full_config_and_model() -> None:
    text = _clip_config("eos").to_dict()
    vision = dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=16
    )
    config = CLIPConfig(text_config=text, vision_config=vision | {"patch_size": 8}, projection_dim=13)
    spec = from_hf(config)
    assert spec.head.classes == 13 and spec.encoder.width == 24
    torch.manual_seed(0)
    ref = perturbed(CLIPModel(config), 0)
    model = converted(ref, spec)  # the image tower and logit scale are left out
    ids = _clip_tokens(50)
    with torch.no_grad():
        want = ref.get_text_features(input_ids=ids)
        want = want if isinstance(want, Tensor) else want.pooler_output
        assert (want - model(ids)).abs().max().item() <= TOL


# -- import: round trip and refusals ------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        BartConfig(**BART_SIZES["odd_untied"]),
        BartConfig(),
        _clip_config("legacy_odd"),
        CLIPConfig(projection_dim=64),
    ],
    ids=["bart_odd", "bart_default", "clip_text", "clip_full"],
)
def test_from_hf_round_trip(config: Any, tmp_path: Path) -> None:
    values = config.to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values), encoding="utf-8")
    spec = from_hf(values)
    assert from_hf(path) == spec
    assert from_hf(str(path)) == spec
    assert from_hf(config) == spec
    # a config.json leaves defaults out: the same spec from the fields that differ
    sparse = {k: v for k, v in values.items() if k in ("model_type",) or k in config.to_diff_dict()}
    assert from_hf(sparse) == spec


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"model_type": "bart", "activation_function": "mish"}, "config.activation_function"),
        ({"model_type": "bart", "normalize_before": True}, "config.normalize_before"),
        ({"model_type": "bart", "add_final_layer_norm": True}, "config.add_final_layer_norm"),
        ({"model_type": "clip_text_model", "hidden_act": "mish"}, "config.hidden_act"),
        ({"model_type": "clip_text_model", "eos_token_id": [2, 3]}, "config.eos_token_id"),
        ({"model_type": "clip", "text_config": {"hidden_act": "mish"}}, "config.text_config.hidden_act"),
    ],
)
def test_unsupported_config_values_are_refused(values: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        from_hf(values)
    assert [p.path for p in info.value.problems] == [field]
    key = field.rpartition(".")[2]
    assert f"{key}=" in str(info.value)
