"""Converted weights give the reference's outputs: torch.nn.Transformer, HF ViT / BERT / GPT-2 and timm ViT.

Each reference gets random weights (so that no zero-initialised part hides a wrong mapping), its state dict
goes through :func:`specvit.convert.convert_state_dict` into the model built from the matching spec, loaded
with ``strict=True``, and both run in fp32 on CPU in eval mode: the largest absolute difference of the
outputs must be at most 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

import specvit
from specvit.compile import build_model
from specvit.convert import convert_state_dict
from specvit.model import SpecModel

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
TIMM_FIXTURE = Path(__file__).parent / "fixtures" / "vit_tiny_patch16_224__depth-2.safetensors"

# torch.nn.Transformer's notices about its nested-tensor fast path and about a float causal mask next to
# bool padding masks (as generate_square_subsequent_mask makes it): about torch, not about the comparison
pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
    pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning"),
]


def _close(ours: Tensor, ref: Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def _randomise(model: nn.Module, seed: int) -> None:
    """Every parameter from N(0, 0.05), then every LayerNorm scale from N(1, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=g))


def _ours(spec: specvit.Spec, state_dict: dict[str, Tensor], source: Any) -> SpecModel:
    model = build_model(spec)
    model.load_state_dict(convert_state_dict(state_dict, source, spec), strict=True)
    return model.eval()


def _right_padding(lengths: list[int], total: int) -> Tensor:
    """(B, total) bool, True = padding, each row padded on the right after its length."""
    return torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None]


# -- torch.nn.Transformer ---------------------------------------------------------------------------------

TORCH_SPEC = """
specvit: 1
name: torch_transformer
model: encoder_decoder
encoder:
  input: {kind: features, dim: 32}
  position: none
  width: 32
  depth: 2
  block:
    heads: 4
    layers: [self_attention, mlp]
    norm: {kind: layernorm, placement: post, eps: 1.0e-5}
    mlp: {hidden: 64, activation: relu}
  final_norm: true
decoder:
  input: {kind: features, dim: 32}
  position: none
  width: 32
  depth: 2
  block:
    heads: 4
    layers: [masked_self_attention, cross_attention, mlp]
    norm: {kind: layernorm, placement: post, eps: 1.0e-5}
    mlp: {hidden: 64, activation: relu}
  final_norm: true
head: none
"""

TORCH_ENCODER_SPEC = """
specvit: 1
name: torch_transformer_encoder
model: encoder
encoder:
  input: {kind: features, dim: 32}
  position: none
  width: 32
  depth: 2
  block:
    heads: 4
    norm: {kind: layernorm, placement: post, eps: 1.0e-5}
    mlp: {hidden: 64, activation: relu}
  final_norm: true
head: none
"""


def _block_overrides(roles: tuple[str, ...], norm_first: bool, activation: str) -> dict[str, str]:
    out = {}
    for role in roles:
        out[f"{role}.block.norm.placement"] = "pre" if norm_first else "post"
        out[f"{role}.block.mlp.activation"] = activation
    return out


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "norm_first"])
def test_torch_transformer(norm_first: bool, activation: str) -> None:
    torch.manual_seed(0)
    ref = nn.Transformer(
        d_model=32,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=64,
        dropout=0.0,
        activation=activation,
        batch_first=True,
        norm_first=norm_first,
    )
    _randomise(ref, 1)
    ref.eval()
    spec = specvit.parse_spec(
        TORCH_SPEC, overrides=_block_overrides(("encoder", "decoder"), norm_first, activation)
    )
    model = _ours(spec, ref.state_dict(), "torch")
    src, tgt = torch.randn(3, 7, 32), torch.randn(3, 5, 32)
    src_pad, tgt_pad = _right_padding([7, 4, 2], 7), _right_padding([5, 3, 1], 5)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        expected = ref(
            src,
            tgt,
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        got = model(src, tgt, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad)
    _close(got, expected)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "norm_first"])
def test_torch_transformer_encoder(norm_first: bool) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
    ref = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(32), enable_nested_tensor=True)
    _randomise(ref, 2)
    ref.eval()
    spec = specvit.parse_spec(
        TORCH_ENCODER_SPEC, overrides=_block_overrides(("encoder",), norm_first, "relu")
    )
    model = _ours(spec, ref.state_dict(), "torch")
    x = torch.randn(3, 6, 32)
    pad = _right_padding([6, 4, 1], 6)
    with torch.no_grad():
        expected = ref(x, src_key_padding_mask=pad)
        got = model(x, key_padding_mask=pad)
    # torch's eval fast path runs padded batches as nested tensors and returns zeros at padded positions,
    # where specvit computes (masked-key) outputs for every query: compare the real tokens only.
    keep = ~pad
    _close(got[keep], expected[keep])


# -- HF transformers ------------------------------------------------------------------------------------


def _vit_spec(head: Any) -> specvit.Spec:
    return specvit.load_spec(
        SPECS / "vit_base_patch16_224.yaml",
        overrides={
            "encoder.input.size": 32,
            "encoder.input.patch": 8,
            "encoder.width": 64,
            "encoder.depth": 2,
            "encoder.block.heads": 4,
            "head": head,
        },
    )


def _vit_config() -> ViTConfig:
    return ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        image_size=32,
        patch_size=8,
        num_channels=3,
        layer_norm_eps=1e-6,  # the spec's eps (HF's default is 1e-12)
        hidden_act="gelu",
        qkv_bias=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=5,
        attn_implementation="eager",
    )


# transformers 5 renamed ViT's modules; Hub checkpoints (and transformers 4) use these names.
_VIT_LEGACY = {
    "attention.q_proj": "attention.attention.query",
    "attention.k_proj": "attention.attention.key",
    "attention.v_proj": "attention.attention.value",
    "attention.o_proj": "attention.output.dense",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}


def _vit_legacy(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for key, value in state_dict.items():
        if ".layers." in key or key.startswith("layers."):
            key = key.replace("layers.", "encoder.layer.", 1)
            for new, old in _VIT_LEGACY.items():
                key = key.replace(f".{new}.", f".{old}.")
        out[key] = value
    return out


def test_hf_vit_model() -> None:
    ref = ViTModel(_vit_config(), add_pooling_layer=False)
    _randomise(ref, 3)
    ref.eval()
    spec = _vit_spec("none")
    model = _ours(spec, ref.state_dict(), "hf")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _close(model(images), ref(pixel_values=images).last_hidden_state)
    legacy = convert_state_dict(_vit_legacy(ref.state_dict()), "hf", spec)
    assert set(legacy) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(legacy[key], value), key


def test_hf_vit_for_image_classification() -> None:
    ref = ViTForImageClassification(_vit_config())
    _randomise(ref, 4)
    ref.eval()
    state = ref.state_dict()
    assert any(k.startswith("vit.") for k in state)
    spec = _vit_spec({"kind": "classifier", "classes": 5, "pool": "cls"})
    model = _ours(spec, state, "hf")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _close(model(images), ref(pixel_values=images).logits)
    legacy = convert_state_dict(_vit_legacy(state), "hf", spec)
    assert set(legacy) == set(model.state_dict())


def _bert() -> tuple[BertModel, specvit.Spec]:
    config = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    ref = BertModel(config, add_pooling_layer=False)
    _randomise(ref, 5)
    spec = specvit.load_spec(
        SPECS / "bert_base.yaml",
        overrides={
            "encoder.input.vocab": 100,
            "encoder.position.max_len": 64,
            "encoder.width": 64,
            "encoder.depth": 2,
            "encoder.block.heads": 4,
            "encoder.block.mlp.hidden": 128,
        },
    )
    return ref.eval(), spec


def test_hf_bert() -> None:
    ref, spec = _bert()
    state = ref.state_dict()
    state["embeddings.position_ids"] = torch.arange(64)[None]  # a buffer older checkpoints carry: ignored
    model = _ours(spec, state, "hf")
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(1, 100, (3, 12), generator=g)
    types = torch.randint(0, 2, (3, 12), generator=g)
    mask = (~_right_padding([12, 7, 3], 12)).long()  # HF: 1 = keep
    with torch.no_grad():
        expected = ref(input_ids=tokens, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = model(tokens, key_padding_mask=~mask.bool(), token_type_ids=types)
    # a padded query attends to the real tokens in both, but compare only the tokens HF defines
    keep = mask.bool()
    _close(got[keep], expected[keep])


def _gpt2() -> tuple[GPT2LMHeadModel, specvit.Spec]:
    config = GPT2Config(
        vocab_size=100,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    ref = GPT2LMHeadModel(config)
    _randomise(ref, 7)  # lm_head.weight is wte.weight: it stays tied
    spec = specvit.load_spec(
        SPECS / "gpt2_small.yaml",
        overrides={
            "decoder.input.vocab": 100,
            "decoder.position.max_len": 64,
            "decoder.width": 64,
            "decoder.depth": 2,
            "decoder.block.heads": 4,
        },
    )
    return ref.eval(), spec


def test_hf_gpt2() -> None:
    ref, spec = _gpt2()
    state = ref.state_dict()
    assert "lm_head.weight" in state
    for i in range(2):  # the causal-mask buffers of older checkpoints: ignored
        state[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    model = _ours(spec, state, "hf")
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _close(model(tokens), ref(input_ids=tokens).logits)


# -- timm ---------------------------------------------------------------------------------------------


def test_timm_fixture() -> None:
    with safe_open(TIMM_FIXTURE, "pt") as f:
        meta = f.metadata()
    # the spec below assumes timm's defaults for everything but depth
    assert meta["timm_model"] == "vit_tiny_patch16_224"
    assert json.loads(meta["timm_kwargs"]) == {"depth": 2}
    tensors = load_file(TIMM_FIXTURE)
    state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    spec = specvit.load_spec(SPECS / "vit_tiny_patch16_224.yaml", overrides={"encoder.depth": 2})
    model = _ours(spec, state, "timm")
    with torch.no_grad():
        _close(model(tensors["input"]), tensors["output"])


TIMM_REG_SPEC = """
specvit: 1
name: timm_vit_registers_layer_scale
model: encoder
encoder:
  input: {kind: image, size: 32, patch: 8}
  prefix: {cls: true, registers: 4}
  position: {kind: learned, include_prefix: true}
  width: 64
  depth: 2
  block:
    heads: 4
    norm: {kind: layernorm, placement: pre, eps: 1.0e-6}
    mlp: {hidden: 256, activation: gelu}
    layer_scale: 1.0e-5
  final_norm: true
head: {kind: classifier, classes: 10, pool: cls}
"""


def _timm_keys(
    *, depth: int, dim: int, hidden: int, patch: int, grid: int, registers: int, classes: int, avg: bool
) -> dict[str, tuple[int, ...]]:
    """The state dict of timm's ``VisionTransformer(class_token=True, reg_tokens=registers, init_values=...,
    no_embed_class=avg, global_pool='avg' if avg else 'token')``, written from timm 1.0's
    ``VisionTransformer.__init__``, ``Block``, ``Attention``, ``Mlp`` and ``LayerScale``."""
    patches = grid * grid
    keys: dict[str, tuple[int, ...]] = {
        "cls_token": (1, 1, dim),
        "reg_token": (1, registers, dim),
        "pos_embed": (1, patches if avg else 1 + registers + patches, dim),
        "patch_embed.proj.weight": (dim, 3, patch, patch),
        "patch_embed.proj.bias": (dim,),
    }
    for i in range(depth):
        b = f"blocks.{i}."
        keys.update(
            {
                b + "norm1.weight": (dim,),
                b + "norm1.bias": (dim,),
                b + "attn.qkv.weight": (3 * dim, dim),
                b + "attn.qkv.bias": (3 * dim,),
                b + "attn.proj.weight": (dim, dim),
                b + "attn.proj.bias": (dim,),
                b + "ls1.gamma": (dim,),
                b + "norm2.weight": (dim,),
                b + "norm2.bias": (dim,),
                b + "mlp.fc1.weight": (hidden, dim),
                b + "mlp.fc1.bias": (hidden,),
                b + "mlp.fc2.weight": (dim, hidden),
                b + "mlp.fc2.bias": (dim,),
                b + "ls2.gamma": (dim,),
            }
        )
    final = "fc_norm" if avg else "norm"  # global_pool='avg' moves the final norm after the pooling
    keys.update(
        {
            f"{final}.weight": (dim,),
            f"{final}.bias": (dim,),
            "head.weight": (classes, dim),
            "head.bias": (classes,),
        }
    )
    return keys


def _timm_reference(state: dict[str, Tensor], images: Tensor, *, heads: int, avg: bool) -> Tensor:
    """timm's ``VisionTransformer.forward`` (``_pos_embed``, ``Block``, ``Attention``, ``forward_head``) in
    functional form, for register tokens and layer scale, which the fixture does not cover."""
    dim, patch = state["cls_token"].shape[-1], state["patch_embed.proj.weight"].shape[-1]

    def norm(x: Tensor, name: str) -> Tensor:
        return F.layer_norm(x, (dim,), state[f"{name}.weight"], state[f"{name}.bias"], eps=1e-6)

    def linear(x: Tensor, name: str) -> Tensor:
        return F.linear(x, state[f"{name}.weight"], state[f"{name}.bias"])

    x = F.conv2d(images, state["patch_embed.proj.weight"], state["patch_embed.proj.bias"], stride=patch)
    x = x.flatten(2).transpose(1, 2)  # (B, N, D)
    b = x.shape[0]
    prefix = [state["cls_token"].expand(b, -1, -1), state["reg_token"].expand(b, -1, -1)]
    if avg:  # no_embed_class: positions for the patches only, added before the prefix is put in front
        x = torch.cat([*prefix, x + state["pos_embed"]], dim=1)
    else:
        x = torch.cat([*prefix, x], dim=1) + state["pos_embed"]
    n = x.shape[1]
    for i in range(len({k.split(".")[1] for k in state if k.startswith("blocks.")})):
        blk = f"blocks.{i}"
        qkv = linear(norm(x, f"{blk}.norm1"), f"{blk}.attn.qkv").reshape(b, n, 3, heads, dim // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, dim)
        x = x + state[f"{blk}.ls1.gamma"] * linear(attn, f"{blk}.attn.proj")
        mlp = linear(F.gelu(linear(norm(x, f"{blk}.norm2"), f"{blk}.mlp.fc1")), f"{blk}.mlp.fc2")
        x = x + state[f"{blk}.ls2.gamma"] * mlp
    num_prefix = 1 + state["reg_token"].shape[1]
    pooled = norm(x[:, num_prefix:].mean(dim=1), "fc_norm") if avg else norm(x, "norm")[:, 0]
    return linear(pooled, "head")


@pytest.mark.parametrize("avg", [False, True], ids=["token_pool", "avg_pool_fc_norm"])
def test_timm_registers_layer_scale(avg: bool) -> None:
    overrides: dict[str, Any] = {}
    if avg:
        overrides = {
            "encoder.position.include_prefix": False,
            "encoder.final_norm": False,
            "head": {"kind": "classifier", "classes": 10, "pool": "mean", "norm": True},
        }
    spec = specvit.parse_spec(TIMM_REG_SPEC, overrides=overrides)
    shapes = _timm_keys(depth=2, dim=64, hidden=256, patch=8, grid=4, registers=4, classes=10, avg=avg)
    g = torch.Generator().manual_seed(9)
    state = {k: 0.05 * torch.randn(s, generator=g) for k, s in shapes.items()}
    for k in state:
        if "norm" in k and k.endswith(".weight"):
            state[k] += 1.0
    out = convert_state_dict(state, "timm", spec)  # raises if any timm key is left over
    model = build_model(spec)
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }
    model.load_state_dict(out, strict=True)
    model.eval()
    images = torch.randn(2, 3, 32, 32, generator=g)
    with torch.no_grad():
        _close(model(images), _timm_reference(state, images, heads=4, avg=avg))


# -- errors -------------------------------------------------------------------------------------------


def test_missing_and_unexpected_keys_are_named() -> None:
    ref, spec = _gpt2()
    state = ref.state_dict()
    del state["transformer.h.1.ln_2.bias"]
    with pytest.raises(ValueError, match=r"missing source keys \(1\): transformer\.h\.1\.ln_2\.bias"):
        convert_state_dict(state, "hf", spec)
    state = ref.state_dict()
    state["transformer.h.0.attn.extra.weight"] = torch.zeros(3)
    with pytest.raises(
        ValueError, match=r"unexpected source keys \(1\): transformer\.h\.0\.attn\.extra\.weight"
    ):
        convert_state_dict(state, "hf", spec)


def test_parts_the_spec_lacks_are_refused() -> None:
    ref = ViTModel(_vit_config(), add_pooling_layer=True)  # the pooler has no counterpart in a spec
    with pytest.raises(ValueError, match=r"unexpected source keys \(2\): pooler\.dense\.weight"):
        convert_state_dict(ref.state_dict(), "hf", _vit_spec("none"))
    state = {k.removeprefix("model."): v for k, v in load_file(TIMM_FIXTURE).items()}
    registers = specvit.load_spec(
        SPECS / "vit_tiny_patch16_224.yaml", overrides={"encoder.depth": 2, "encoder.prefix.registers": 4}
    )
    with pytest.raises(ValueError, match=r"(?s)missing source keys \(1\): reg_token.*encoder\.pos_embed"):
        convert_state_dict(state, "timm", registers)


def test_untied_lm_head_is_refused_for_a_tied_spec() -> None:
    ref, spec = _gpt2()
    state = ref.state_dict()
    # A head of its own, drawn like the rest (N(0, 0.05)). "wte + 1" made every logit a sum of terms near 1
    # that cancel, where two fp32 summation orders differed by 5.7e-6 (over half the tolerance); now 4.8e-7.
    untied_head = 0.05 * torch.randn(
        state["lm_head.weight"].shape, generator=torch.Generator().manual_seed(11)
    )
    state["lm_head.weight"] = untied_head
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from transformer\.wte\.weight"):
        convert_state_dict(state, "hf", spec)
    untied = specvit.parse_spec(spec.model_dump(), overrides={"head.tied": False})
    model = _ours(untied, state, "hf")
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        hidden = ref.transformer(input_ids=tokens).last_hidden_state  # (B, S, D) after ln_f
        _close(model(tokens), hidden @ untied_head.T)
        tied = hidden @ state["transformer.wte.weight"].T  # what a model still reading wte would give
        assert (tied - hidden @ untied_head.T).abs().max() > 0.1


def test_structures_a_format_cannot_hold_are_refused() -> None:
    post = specvit.load_spec(
        SPECS / "vit_tiny_patch16_224.yaml",
        overrides={"encoder.depth": 2, "encoder.block.norm.placement": "post"},
    )
    with pytest.raises(ValueError, match="pre-norm"):
        convert_state_dict({}, "timm", post)
    _, gpt2 = _gpt2()
    with pytest.raises(ValueError, match="source 'torch' converts"):
        convert_state_dict({}, "torch", gpt2)
    with pytest.raises(ValueError, match="source must be one of"):
        convert_state_dict({}, "keras", gpt2)  # type: ignore[arg-type]
