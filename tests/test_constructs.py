"""Constructs of the language, each stated in a spec and checked in float64 against the model that
published it (HF transformers, built from a config with random weights): LayerNorm without parameters
(OLMo), QK-norm over all heads (OLMo 2), RMSNorm scaling by 1 + w (Gemma), squared ReLU and LayerNorm1P
(Nemotron), rotary over a channel count with interleaved pairs (GPT-J), the [sin | cos] sinusoid table
(Marian) and its tensor2tensor frequencies from an offset (M2M100).

Every test has a control: the same spec with only that construct switched off must fail the same
assertion, so a test cannot pass because the construct does nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from reference import float64_reference, perturbed
from test_eject import defined_twice
from torch import nn

from specvit.compile import build_graph, build_model, eject
from specvit.errors import SpecError
from specvit.model import SpecModel
from specvit.spec.loader import parse_spec

VOCAB, N, TOL = 97, 11, 1e-10

Rename = list[tuple[str, str | tuple[str, ...]]]
"""(regex over specvit's keys, HF key template or templates to concatenate); groups fill ``{0}``..."""


def _hf(config_cls: type, model_cls: type, seed: int, **kw: Any) -> nn.Module:
    config = config_cls(
        **({"vocab_size": VOCAB, "num_hidden_layers": 2, "attn_implementation": "eager"} | kw)
    )
    torch.manual_seed(seed)
    return _double(perturbed(model_cls(config), seed))


def _double(ref: nn.Module) -> nn.Module:
    """``ref`` in float64 but for its RoPE frequencies: HF computes the tables from float32 frequencies
    (``inv_freq.float()``) in every dtype, as specvit does."""
    ref.double()
    for module in ref.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name.endswith("inv_freq"):
                setattr(module, name, buffer.float())
    return ref


def _decoder(block: dict[str, Any], position: dict[str, Any], width: int, **head: Any) -> dict[str, Any]:
    return {
        "specvit": 1,
        "name": "construct",
        "model": "decoder",
        "decoder": {
            "input": {"kind": "tokens", "vocab": VOCAB},
            "position": position,
            "width": width,
            "depth": 2,
            "block": {"layers": ["masked_self_attention", "mlp"], **block},
        },
        "head": {"kind": "lm", **head},
    }


def renamed(
    model: nn.Module, source: dict[str, torch.Tensor], rename: Rename
) -> tuple[dict[str, Any], set[str]]:
    """For each of ``model``'s keys that ``rename`` names and whose HF tensors all exist and fit its shape
    (a control's tables of another size do not), those tensors concatenated; and the HF names used."""
    weights, used = {}, set()
    for key, value in model.state_dict().items():
        for pattern, template in rename:
            if m := re.fullmatch(pattern, key):
                names = tuple(
                    t.format(*m.groups()) for t in ((template,) if isinstance(template, str) else template)
                )
                if all(n in source for n in names) and sum(source[n].numel() for n in names) == value.numel():
                    weights[key] = torch.cat([source[n].reshape(-1) for n in names]).view(value.shape)
                    used.update(names)
                break
    return weights, used


def _ours(spec: dict[str, Any], ref: nn.Module, rename: Rename, *, strict: bool = True) -> SpecModel:
    """The spec's model in float64 with ``ref``'s weights renamed into it; every HF parameter is used."""
    model = build_model(parse_spec(spec)).double().eval()
    source = ref.state_dict()
    out, used = renamed(model, source, rename)
    if tied := "lm_head.weight" in source and "head.fc.weight" not in out:
        assert source["lm_head.weight"].equal(source["model.embed_tokens.weight"])
    unused = [k for k in source if k not in used and not (tied and k == "lm_head.weight")]
    assert not unused or not strict, f"HF weights with no place: {unused}"
    model.load_state_dict(out, strict=strict)  # strict: a key that did not fit is missing, and fails here
    return model


def _diff(model: SpecModel, ref: nn.Module) -> float:
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        with float64_reference():
            theirs = ref(ids).logits
    return (ours - theirs).abs().max().item()


def _llama_keys(norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")) -> Rename:
    layer = r"model.layers.{0}."
    return [
        (r"decoder\.tok_embed\.weight", "model.embed_tokens.weight"),
        (r"decoder\.blocks\.(\d+)\.norm1\.weight", layer + norms[0] + ".weight"),
        (r"decoder\.blocks\.(\d+)\.norm2\.weight", layer + norms[1] + ".weight"),
        (
            r"decoder\.blocks\.(\d+)\.attn\.qkv\.weight",
            tuple(layer + f"self_attn.{c}_proj.weight" for c in "qkv"),
        ),
        (r"decoder\.blocks\.(\d+)\.attn\.proj\.weight", layer + "self_attn.o_proj.weight"),
        (r"decoder\.blocks\.(\d+)\.attn\.([qk])_norm\.weight", layer + "self_attn.{1}_norm.weight"),
        (
            r"decoder\.blocks\.(\d+)\.mlp\.fc1\.weight",
            (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"),
        ),
        (r"decoder\.blocks\.(\d+)\.mlp\.fc2\.weight", layer + "mlp.down_proj.weight"),
        (r"decoder\.norm\.weight", "model.norm.weight"),
        (r"head\.fc\.weight", "lm_head.weight"),
    ]


def block_keys(
    layer: str, qkv: tuple[str, str, str], proj: str, norm1: str, fc1: str, fc2: str, norm2: str
) -> Rename:
    """The rename table of an encoder's blocks in the BERT layout (biased q, k, v, output projection, two
    MLP layers, a norm after each sublayer): HF's names under ``layer`` (``{0}`` the block's index), each
    a module whose ``weight`` and ``bias`` map to specvit's."""
    block = r"encoder\.blocks\.(\d+)\."
    return [
        (block + r"attn\.qkv\.(\w+)", tuple(layer + c + ".{1}" for c in qkv)),
        *(
            (block + ours.replace(".", r"\.") + r"\.(\w+)", layer + theirs + ".{1}")
            for ours, theirs in (
                ("attn.proj", proj), ("norm1", norm1), ("mlp.fc1", fc1), ("mlp.fc2", fc2), ("norm2", norm2)
            )
        ),
    ]  # fmt: skip


def _check(build: Callable[[bool], float]) -> None:
    """``build(on)`` gives the max abs difference with the construct on, and off (the control)."""
    assert build(True) <= TOL
    with pytest.raises(AssertionError):
        assert build(False) <= TOL


# --------------------------------------------------------------------------------------- OLMo, OLMo 2


def _olmo() -> nn.Module:
    from transformers import OlmoConfig, OlmoForCausalLM

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40)
    return _hf(OlmoConfig, OlmoForCausalLM, 1, **kw)


def test_layernorm_without_parameters_is_olmos() -> None:
    ref = _olmo()

    def diff(on: bool) -> float:
        norm = {"kind": "layernorm", "eps": 1e-5, "affine": not on}
        block = {
            "heads": 4,
            "kv_heads": 2,
            "norm": norm,
            "mlp": {"hidden": 40, "activation": "swiglu", "bias": False},
        }
        spec = _decoder(block | {"qkv_bias": False, "proj_bias": False}, {"kind": "rope"}, 48)
        model = _ours(spec, ref, _llama_keys(), strict=on)
        if not on:  # the control's norms have weights and biases: moved off their init like every weight
            perturbed(model, seed=3)
        return _diff(model, ref)

    _check(diff)


def _olmo2_block(scope: str) -> dict[str, Any]:
    return {
        "heads": 4,
        "kv_heads": 2,
        "norm": {"kind": "rmsnorm", "eps": 1e-5, "placement": "res_post"},
        "qk_norm": scope,
        "qkv_bias": False,
        "proj_bias": False,
        "mlp": {"hidden": 40, "activation": "swiglu", "bias": False},
    }


def test_qk_norm_over_all_heads_is_olmo2s() -> None:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40)
    ref = _hf(Olmo2Config, Olmo2ForCausalLM, 2, **kw)
    keys = _llama_keys(("post_attention_layernorm", "post_feedforward_layernorm"))
    model = _ours(_decoder(_olmo2_block("all"), {"kind": "rope"}, 48), ref, keys)
    assert model.decoder.blocks[0].attn.q_norm.weight.shape == (4 * 12,)
    assert _diff(model, ref) <= TOL

    # the control: per-head norms; with the QK-norm weights at 1 both have the same parameters
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.fill_(1.0)

    def diff(on: bool) -> float:
        return _diff(
            _ours(
                _decoder(_olmo2_block("all" if on else "head"), {"kind": "rope"}, 48), ref, keys, strict=on
            ),
            ref,
        )

    _check(diff)


# ------------------------------------------------------------------------------------- Gemma, Nemotron


def test_rmsnorm_scaling_by_one_plus_w_is_gemmas() -> None:
    from transformers import GemmaConfig, GemmaForCausalLM

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=40)
    ref = _hf(GemmaConfig, GemmaForCausalLM, 4, **kw)
    embed = ref.model.embed_tokens  # sqrt(width), a float32 buffer: in float64, the float64 value
    embed.embed_scale = torch.tensor(48**0.5, dtype=torch.float64)

    def diff(on: bool) -> float:
        block = {
            "heads": 4,
            "kv_heads": 1,
            "head_dim": 16,
            "norm": {"kind": "rmsnorm", "eps": 1e-6, "unit_offset": on},
            "qkv_bias": False,
            "proj_bias": False,
            "mlp": {"hidden": 40, "activation": "geglu_tanh", "bias": False},
        }
        spec = _decoder(block, {"kind": "rope"}, 48, tied=True)
        spec["decoder"]["input"]["scale"] = True
        return _diff(_ours(spec, ref, _llama_keys()), ref)

    _check(diff)


def _nemotron_keys() -> Rename:
    layer = r"model.layers.{0}."
    keys = _llama_keys()
    norms = [
        (rf"decoder\.blocks\.(\d+)\.norm{i}\.bias", layer + name + ".bias")
        for i, name in ((1, "input_layernorm"), (2, "post_attention_layernorm"))
    ]
    mlp = [(r"decoder\.blocks\.(\d+)\.mlp\.fc1\.weight", layer + "mlp.up_proj.weight")]
    return [*norms, *mlp, *keys, (r"decoder\.norm\.bias", "model.norm.bias")]


@pytest.mark.parametrize("construct", ["relu2", "unit_offset"])
def test_squared_relu_and_layernorm1p_are_nemotrons(construct: str) -> None:
    from transformers import NemotronConfig, NemotronForCausalLM

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40)
    ref = _hf(NemotronConfig, NemotronForCausalLM, 5, partial_rotary_factor=0.5, **kw)
    assert ref.config.hidden_act == "relu2"

    def diff(on: bool) -> float:
        block = {
            "heads": 4,
            "kv_heads": 2,
            "norm": {"kind": "layernorm", "eps": 1e-5, "unit_offset": on or construct != "unit_offset"},
            "qkv_bias": False,
            "proj_bias": False,
            "mlp": {
                "hidden": 40,
                "activation": "relu2" if on or construct != "relu2" else "relu",
                "bias": False,
            },
        }
        return _diff(
            _ours(_decoder(block, {"kind": "rope", "fraction": 0.5}, 48), ref, _nemotron_keys()), ref
        )

    _check(diff)


# -------------------------------------------------------------------------------------------------- GPT-J

GPTJ_HEAD, GPTJ_ROTARY = 44, 30  # 30 of 44 channels: no fraction gives it (int(44 * 30 / 44) == 29)


def _gptj_spec(layout: str) -> dict[str, Any]:
    block = {
        "heads": 2,
        "parallel": True,
        "norm": {"kind": "layernorm", "eps": 1e-5},
        "qkv_bias": False,
        "proj_bias": False,
        "mlp": {"hidden": 40, "activation": "gelu_tanh"},
    }
    position = {"kind": "rope", "dims": GPTJ_ROTARY, "layout": layout}
    return _decoder(block, position, 2 * GPTJ_HEAD, bias=True)


def _gptj_keys() -> Rename:
    layer = r"transformer.h.{0}."
    return [
        (r"decoder\.tok_embed\.weight", "transformer.wte.weight"),
        (r"decoder\.blocks\.(\d+)\.norm[12]\.(weight|bias)", layer + "ln_1.{1}"),  # one norm feeds both
        (r"decoder\.blocks\.(\d+)\.attn\.qkv\.weight", tuple(layer + f"attn.{c}_proj.weight" for c in "qkv")),
        (r"decoder\.blocks\.(\d+)\.attn\.proj\.weight", layer + "attn.out_proj.weight"),
        (r"decoder\.blocks\.(\d+)\.mlp\.fc1\.(weight|bias)", layer + "mlp.fc_in.{1}"),
        (r"decoder\.blocks\.(\d+)\.mlp\.fc2\.(weight|bias)", layer + "mlp.fc_out.{1}"),
        (r"decoder\.norm\.(weight|bias)", "transformer.ln_f.{0}"),
        (r"head\.fc\.(weight|bias)", "lm_head.{0}"),
    ]


def test_rotary_over_a_channel_count_in_interleaved_pairs_is_gptjs() -> None:
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(
        vocab_size=VOCAB, n_embd=2 * GPTJ_HEAD, n_head=2, n_layer=2, n_inner=40, rotary_dim=GPTJ_ROTARY
    )
    torch.manual_seed(6)
    ref = _double(perturbed(GPTJForCausalLM(config), 6))

    def diff(on: bool) -> float:
        return _diff(_ours(_gptj_spec("interleaved" if on else "half"), ref, _gptj_keys()), ref)

    _check(diff)


def test_a_fraction_cannot_state_gptjs_rotary_width() -> None:
    spec = _gptj_spec("interleaved")
    spec["decoder"]["position"] = {"kind": "rope", "fraction": GPTJ_ROTARY / GPTJ_HEAD}
    with pytest.raises(SpecError, match=r"rotates 29 channels, which must be even"):
        parse_spec(spec)
    spec["decoder"]["position"] = {"kind": "rope", "dims": 31}
    with pytest.raises(SpecError, match=r"decoder\.position\.dims.*rope over 31 channels of head dim 44"):
        parse_spec(spec)


# ------------------------------------------------------------------------------------------------ Marian


def _sincos_added(width: int, position: dict[str, Any], tokens: int = 40) -> torch.Tensor:
    """The table a features encoder of ``position`` adds to ``tokens`` zero tokens, in float64."""
    spec = {
        "specvit": 1,
        "name": "sincos",
        "model": "encoder",
        "encoder": {
            "input": {"kind": "features", "dim": width, "project": False},
            "position": {"kind": "sincos", **position},
            "width": width,
            "depth": 1,
            "block": {"heads": 2},
            "final_norm": False,
        },
        "head": {"kind": "none"},
    }
    model = build_model(parse_spec(spec)).double().eval()
    with torch.no_grad():
        return model.encoder.pos_embed(torch.zeros(1, tokens, width, dtype=torch.float64))[0]  # zeros + table


@pytest.mark.parametrize("width", [48, 30])
def test_sin_cos_concatenated_table_is_marians(width: int) -> None:
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    table = MarianSinusoidalPositionalEmbedding(64, width)
    table.weight.data = table.create_weight()

    def diff(on: bool) -> float:
        added = _sincos_added(width, {"layout": "concat" if on else "interleaved"})
        return (added - table.weight[:40].double()).abs().max().item()

    _check(diff)


# ------------------------------------------------------------------------------------------------ M2M100


@pytest.mark.parametrize(("width", "pad"), [(48, 1), (30, 0)])
def test_tensor2tensor_sinusoids_from_an_offset_are_m2m100s(width: int, pad: int) -> None:
    """M2M100 (as fairseq) spaces its frequencies base^(-i / (width/2 - 1)) and numbers the tokens from
    pad_token_id + 1: ``frequencies: tensor2tensor`` and ``offset``. Either switched off fails."""
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

    with torch.no_grad():  # 40 tokens, none the pad token: positions pad + 1 .. pad + 40
        want = M2M100SinusoidalPositionalEmbedding(64, width, padding_idx=pad)(torch.full((1, 40), 5))[0]
    position = {"layout": "concat", "frequencies": "tensor2tensor", "offset": pad + 1}
    assert (_sincos_added(width, position) - want.double()).abs().max().item() <= TOL
    for control in ({"frequencies": "paper"}, {"offset": 0}):
        assert (_sincos_added(width, position | control) - want.double()).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------------- eject

EJECTED = {
    "olmo": _decoder({"heads": 4, "norm": {"kind": "layernorm", "affine": False}}, {"kind": "rope"}, 48),
    "olmo2": _decoder(_olmo2_block("all"), {"kind": "rope"}, 48),
    "gemma": _decoder(
        {"heads": 4, "norm": {"kind": "rmsnorm", "unit_offset": True}, "qk_norm": True}, {"kind": "rope"}, 48
    ),
    "nemotron": _decoder(
        {
            "heads": 4,
            "norm": {"kind": "layernorm", "unit_offset": True},
            "mlp": {"activation": "relu2", "norm": True},
        },
        {"kind": "rope", "fraction": 0.5},
        48,
    ),
    "gptj": _gptj_spec("interleaved"),
    "sincos": _decoder({"heads": 4}, {"kind": "sincos", "layout": "concat"}, 48),
}


@pytest.mark.parametrize("name", EJECTED)
def test_the_constructs_eject_to_the_same_model(name: str) -> None:
    graph = build_graph(parse_spec(EJECTED[name]), batch=2, seq_len=N)
    torch.manual_seed(0)
    compiled = build_model(graph).eval()
    with torch.no_grad():  # off their init (unit offsets start at 0), so a dropped weight shows
        for p in compiled.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    text = eject(graph)
    assert defined_twice(text) == []  # Norm is a layer and what make_norm builds: written once, in full
    namespace: dict[str, Any] = {"__name__": "ejected"}
    exec(compile(text, "<ejected>", "exec"), namespace)
    ejected = namespace["Model"]().eval()
    ejected.load_state_dict(compiled.state_dict())
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ejected(ids) - compiled(ids)).abs().max().item() == 0.0
