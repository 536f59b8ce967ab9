"""MAE (He et al. 2021): specs from HF ViTMAE configs, weights through the converter, and the same loss,
logits, mask and ids_restore as ``ViTMAEForPreTraining`` for the same noise; the masking ops against their
definition; the preset's parameter count; the refusals; and pre-training that lowers the masked loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference import converted, perturbed
from transformers import ViTMAEConfig, ViTMAEForPreTraining
from transformers.models.vit_mae.modeling_vit_mae import build_2d_sinusoidal_position_embedding

import specvit
from specvit.errors import SpecError
from specvit.inputs import InputError
from specvit.nn.masking import (
    MaskTokens,
    keep_tokens,
    masked_patch_mse,
    masked_patches,
    patchify,
    random_shuffle,
    restore_ids,
)

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5

SIZES: dict[str, dict[str, Any]] = {
    # 4x4 patches of 4 px, 75% masked; decoder narrower with more heads (head dim 4 vs 8)
    "small": dict(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        decoder_hidden_size=24,
        decoder_num_hidden_layers=1,
        decoder_num_attention_heads=6,
        decoder_intermediate_size=36,
    ),
    # normalised pixels, 1 channel, ratio 0.6 (int(36 * 0.4) = 14 kept), no qkv bias, tanh GELU
    "norm_pix": dict(
        image_size=24,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        decoder_hidden_size=20,
        decoder_num_hidden_layers=2,
        decoder_num_attention_heads=5,
        decoder_intermediate_size=24,
        mask_ratio=0.6,
        norm_pix_loss=True,
        qkv_bias=False,
        hidden_act="gelu_new",
        layer_norm_eps=1e-6,
    ),
    # decoder wider than the encoder
    "wide_decoder": dict(
        image_size=20,
        patch_size=5,
        hidden_size=12,
        num_hidden_layers=1,
        num_attention_heads=3,
        intermediate_size=24,
        decoder_hidden_size=48,
        decoder_num_hidden_layers=2,
        decoder_num_attention_heads=3,
        decoder_intermediate_size=96,
        mask_ratio=0.5,
        norm_pix_loss=True,
    ),
}


def _sincos(table: torch.Tensor, grid: int) -> torch.Tensor:
    """HF's own fixed table for ``table`` (1, 1 + N, D), as ``ViTMAEEmbeddings.initialize_weights`` and
    ``ViTMAEDecoder.initialize_weights`` write it: zero for the class token, the h and w halves swapped."""
    pos = build_2d_sinusoidal_position_embedding(grid, grid, table.shape[-1], cls_token=True)
    half = pos.shape[-1] // 2
    return torch.cat([pos[..., half:], pos[..., :half]], dim=-1).unsqueeze(0)


def _reference(config: ViTMAEConfig, seed: int) -> ViTMAEForPreTraining:
    """HF's model with random seeded weights moved off init, and its two frozen (requires_grad=False)
    position tables set to the sin-cos tables of HF's initialize_weights (a model built from a config holds
    zeros there, transformers 5's _init_weights; pretrained checkpoints hold the sin-cos tables)."""
    torch.manual_seed(seed)
    ref = perturbed(ViTMAEForPreTraining(config), seed)
    grid = config.image_size // config.patch_size
    with torch.no_grad():
        for table in (ref.vit.embeddings.position_embeddings, ref.decoder.decoder_pos_embed):
            table.copy_(_sincos(table, grid))
    return ref


@pytest.mark.parametrize("size", SIZES)
def test_pretraining_equals_hf(size: str) -> None:
    config = ViTMAEConfig(**SIZES[size])
    ref = _reference(config, seed=len(size))
    spec = specvit.from_hf(config)
    ours = converted(ref, spec)
    gen = torch.Generator().manual_seed(1)
    c, s = config.num_channels, config.image_size
    images = torch.randn(3, c, s, s, generator=gen)
    noise = torch.rand(3, (s // config.patch_size) ** 2, generator=gen)
    with torch.no_grad():
        want = ref(pixel_values=images, noise=noise)
        got = ours(images, noise)
    assert set(got) == {"loss", "logits", "mask", "ids_restore"}
    assert torch.equal(got["ids_restore"], want.ids_restore)
    assert torch.equal(got["mask"], want.mask)
    assert got["logits"].shape == want.logits.shape
    assert (got["logits"] - want.logits).abs().max().item() <= ATOL
    assert abs(got["loss"].item() - want.loss.item()) <= ATOL
    kept = int(noise.shape[1] * (1 - config.mask_ratio))
    assert got["mask"].sum(1).tolist() == [noise.shape[1] - kept] * 3


def test_the_preset_is_hf_vit_mae_base() -> None:
    """The preset equals the spec of ViTMAEConfig's defaults (facebook/vit-mae-base) and has its trainable
    parameters: 111,907,840 in HF's model less its two frozen sin-cos tables (197 x (768 + 512))."""
    preset = specvit.load_spec(ROOT / "specs" / "mae_vit_base_patch16.yaml")
    imported = specvit.from_hf(ViTMAEConfig())
    assert preset.model_dump(exclude={"name", "description"}) == imported.model_dump(
        exclude={"name", "description"}
    )
    with torch.device("meta"):
        hf = ViTMAEForPreTraining(ViTMAEConfig())
    assert sum(p.numel() for p in hf.parameters()) == 111_907_840
    trainable = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    assert trainable == 111_655_680 == 111_907_840 - 197 * (768 + 512)
    graph = specvit.build_graph(preset)
    assert sum(a["params"] for _, a in graph.nx.nodes(data=True)) == trainable


def test_masking_ops_follow_their_definition() -> None:
    """Kept = the first `keep` of argsort(noise); ids_restore inverts the shuffle; mask 1 = removed; the mask
    token fills the removed places, the visible tokens go back to their patches, the prefix stays first."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64)
    noise = torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.7, 0.2], [0.0, 0.8, 0.6, 0.4, 0.2, 1.0]])
    ids = random_shuffle(x, noise)
    assert ids.tolist() == [[1, 5, 3, 0, 4, 2], [0, 4, 3, 2, 1, 5]]
    restore = restore_ids(ids)
    assert torch.equal(torch.gather(ids, 1, restore), torch.arange(6).expand(2, 6))
    assert masked_patches(restore, 2).tolist() == [[1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 1]]
    visible = keep_tokens(x, ids, 2)
    assert torch.equal(visible[0], x[0, [1, 5]]) and torch.equal(visible[1], x[1, [0, 4]])
    fill = MaskTokens(3, prefix=1).double()
    with torch.no_grad():
        fill.mask_token.fill_(7.0)
    cls = torch.full((2, 1, 3), -1.0, dtype=torch.float64)
    out = fill(torch.cat((cls, visible), 1), ids_restore=restore)  # (2, 7, 3)
    assert torch.equal(out[:, 0], cls[:, 0])
    assert torch.equal(out[0, 1 + 1], x[0, 1]) and torch.equal(out[0, 1 + 5], x[0, 5])
    assert torch.equal(out[1, 1 + 0], x[1, 0]) and torch.equal(out[1, 1 + 4], x[1, 4])
    masked = masked_patches(restore, 2).bool()
    assert (out[:, 1:][masked] == 7.0).all()


def test_the_same_noise_gives_the_same_mask_and_no_noise_draws_one() -> None:
    spec = specvit.from_hf(ViTMAEConfig(**SIZES["small"]))
    torch.manual_seed(0)
    model = specvit.build_model(spec).eval()
    images = torch.randn(2, 3, 16, 16)
    noise = torch.rand(2, 16)
    with torch.no_grad():
        a, b = model(images, noise), model(images, noise)
        c, d = model(images), model(images)
    assert torch.equal(a["logits"], b["logits"]) and torch.equal(a["mask"], b["mask"])
    assert not torch.equal(c["ids_restore"], d["ids_restore"])  # 16! orders: two equal draws never happen
    assert c["mask"].sum().item() == d["mask"].sum().item() == 2 * 12


def test_config_fields_without_an_exact_spec_are_refused() -> None:
    with pytest.raises(SpecError, match=r"config\.hidden_dropout_prob"):
        specvit.from_hf(ViTMAEConfig(**SIZES["small"], hidden_dropout_prob=0.1))
    with pytest.raises(
        SpecError, match=r"config\.mask_ratio: vit_mae config has mask_ratio=0\.99: it keeps 0 of 16"
    ):
        specvit.from_hf(ViTMAEConfig(**SIZES["small"], mask_ratio=0.99))
    with pytest.raises(SpecError, match=r"config\.image_size"):
        specvit.from_hf(ViTMAEConfig(**(SIZES["small"] | {"image_size": [16, 20]})))


def _spec(**changes: Any) -> str:
    text = (ROOT / "specs" / "mae_vit_base_patch16.yaml").read_text()
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "masking: {ratio: 0.75}",
            "masking: {ratio: 0.999}",
            "encoder.masking.ratio: ratio 0.999 keeps 0 of 196 patches",
        ),
        (
            "  masking: {ratio: 0.75}\n",
            "",
            "decoder.input.kind: an unmask input puts back the patches an encoder's masking removed",
        ),
        (
            "position: sincos2d\n  width: 768",
            "position: {kind: rope2d}\n  width: 768",
            "encoder.position: rope2d positions do not follow the tokens through the masking",
        ),
        (
            "input: {kind: unmask}",
            "input: {kind: unmask}\n  prefix: {cls: true}",
            "decoder.prefix: an unmask decoder carries the encoder's prefix tokens",
        ),
        (
            "head: {kind: patches, loss: masked_mse}",
            "head: {kind: classifier, classes: 3, pool: mean}",
            "head.kind: an unmask decoder's output is the pixels of every patch and the mask",
        ),
    ],
)
def test_bad_masking_specs_are_refused(tmp_path: Path, old: str, new: str, message: str) -> None:
    path = tmp_path / "mae.yaml"
    path.write_text(_spec(**{old: new}))
    with pytest.raises(SpecError) as err:
        specvit.load_spec(path)
    assert message in str(err.value)


TINY = """
specvit: 1
name: mae_tiny
model: encoder_decoder
encoder:
  input: {kind: image, size: 16, patch: 4, channels: 3}
  masking: {ratio: 0.75}
  prefix: {cls: true}
  position: sincos2d
  width: 32
  depth: 2
  block: {heads: 4, layers: [self_attention, mlp]}
decoder:
  input: {kind: unmask}
  position: sincos2d
  width: 32
  depth: 1
  block: {heads: 4, layers: [self_attention, mlp]}
head: {kind: patches, loss: masked_mse}
"""


def _gradients(n: int, gen: torch.Generator) -> torch.Tensor:
    """(n, 3, 16, 16) images, each channel a random linear ramp over the image: a masked patch follows from
    the visible ones."""
    coords = torch.linspace(-1, 1, 16)
    ys, xs = coords[:, None].expand(16, 16), coords[None, :].expand(16, 16)
    a, b, c = (torch.randn(n, 3, 1, 1, generator=gen) for _ in range(3))
    return a + b * ys + c * xs


def test_pretraining_lowers_the_masked_loss(tmp_path: Path) -> None:
    """200 Adam steps on synthetic ramps: the masked loss on held-out images (fixed noise) falls far below
    its start and below the loss of predicting every masked pixel as its image's visible mean, which needs
    no model (the control)."""
    path = tmp_path / "mae_tiny.yaml"
    path.write_text(TINY)
    torch.manual_seed(0)
    model = specvit.build_model(path)
    gen = torch.Generator().manual_seed(0)
    held, noise = _gradients(64, gen), torch.rand(64, 16, generator=gen)

    def held_out() -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            out = model(held, noise)
        model.train()
        visible = (1 - out["mask"])[..., None]  # (B, N, 1)
        target = patchify(held, (4, 4))  # (B, N, 48)
        mean = (target * visible).sum((1, 2)) / (visible.sum((1, 2)) * 48)  # (B,) visible mean
        guess = mean[:, None, None].expand_as(target)
        return out["loss"].item(), masked_patch_mse(guess, held, out["mask"], (4, 4)).item()

    start, control = held_out()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(200):
        loss = model(_gradients(32, gen))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    end, _ = held_out()
    assert end < 0.25 * start
    assert end < 0.5 * control


# transformers 5 renamed ViTMAE's modules; Hub checkpoints (facebook/vit-mae-*) and transformers 4 use these.
_LEGACY = {
    "attention.q_proj": "attention.attention.query",
    "attention.k_proj": "attention.attention.key",
    "attention.v_proj": "attention.attention.value",
    "attention.o_proj": "attention.output.dense",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}


def test_transformers_4_names_convert_to_the_same_weights() -> None:
    config = ViTMAEConfig(**SIZES["small"])
    ref = _reference(config, seed=0)
    spec = specvit.from_hf(config)
    legacy = {}
    for key, value in ref.state_dict().items():
        key = key.replace("vit.layers.", "vit.encoder.layer.")
        if "_layers." in key or ".layer." in key:
            for new, old in _LEGACY.items():
                key = key.replace(f".{new}.", f".{old}.")
        legacy[key] = value
    assert "decoder.decoder_layers.0.attention.attention.query.weight" in legacy
    got = specvit.convert_state_dict(legacy, "hf", spec)
    want = specvit.convert_state_dict(ref.state_dict(), "hf", spec)
    assert set(got) == set(want) == set(specvit.build_model(spec).state_dict())
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_position_tables_other_than_the_spec_computes_are_refused() -> None:
    """HF's frozen sin-cos tables are checked, not loaded: a model built from a config holds zeros there
    (transformers 5), which specvit's sincos2d positions would not reproduce."""
    config = ViTMAEConfig(**SIZES["small"])
    torch.manual_seed(0)
    zeros = ViTMAEForPreTraining(config).state_dict()
    assert not zeros["decoder.decoder_pos_embed"].any()
    with pytest.raises(ValueError, match="frozen tables unlike the ones the spec computes") as err:
        specvit.convert_state_dict(zeros, "hf", specvit.from_hf(config))
    assert "vit.embeddings.position_embeddings" in str(err.value)
    assert "decoder.decoder_pos_embed" in str(err.value)


def test_the_graph_draws_the_visible_and_masked_split() -> None:
    """The preset's masking nodes and their shapes: 49 of 196 patches enter the encoder's blocks (with the
    class token: 50), the decoder gets all 196 back (197), the head predicts 16 x 16 x 3 pixels of each."""
    graph = specvit.build_graph(specvit.load_spec(ROOT / "specs" / "mae_vit_base_patch16.yaml"))
    shapes = {n: graph[n]["shape"] for n in graph}
    assert shapes["encoder.noise"] == ("B", 196)
    assert shapes["encoder.shuffle"] == shapes["encoder.restore"] == shapes["encoder.mask"] == ("B", 196)
    assert shapes["encoder.keep"] == ("B", 49, 768)
    assert shapes["encoder.blocks.0.attn"] == ("B", 50, 768)
    assert shapes["decoder.embed"] == ("B", 50, 512)
    assert shapes["decoder.unshuffle"] == shapes["decoder.blocks.7.mlp"] == ("B", 197, 512)
    assert shapes["head.fc"] == ("B", 196, 768) and shapes["head.loss"] == ()
    assert graph["decoder.unshuffle"]["params"] == 512  # the mask token
    assert sorted(u for u, _ in graph.nx.in_edges("decoder.unshuffle")) == [
        "decoder.embed",
        "encoder.restore",
    ]
    assert graph["output"]["p"].keys == ("loss", "logits", "mask", "ids_restore")


def test_noise_of_the_wrong_shape_is_refused() -> None:
    model = specvit.build_model(specvit.from_hf(ViTMAEConfig(**SIZES["small"])))
    with pytest.raises(
        InputError,
        match=r"noise: expected \(batch, 16\) \(masking noise\), got \(2, 15\): dimension 1 must be 16",
    ):
        model(torch.randn(2, 3, 16, 16), torch.rand(2, 15))
