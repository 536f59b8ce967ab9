"""The models are real: tiny ones learn small tasks on CPU, with fixed seeds and no downloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import specvit

ROOT = Path(__file__).resolve().parents[1]

BOS, FIRST, VOCAB, LENGTH = 1, 2, 12, 8


def _reverse_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(FIRST, VOCAB, (n, LENGTH), generator=gen)
    return src, src.flip(1)


def test_encoder_decoder_learns_to_reverse() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = specvit.build_model(ROOT / "specs" / "tiny_seq2seq.yaml")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        src, tgt = _reverse_batch(64, gen)
        tgt_in = torch.cat((torch.full((64, 1), BOS), tgt[:, :-1]), dim=1)
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    src, tgt = _reverse_batch(256, gen)
    out = model.generate(src, LENGTH, bos_id=BOS)[:, 1:]
    accuracy = (out == tgt).float().mean().item()
    assert accuracy >= 0.99, accuracy


VIT = """specvit: 1
name: quadrants
model: encoder
encoder:
  input: {kind: image, size: 16, patch: 4, channels: 1}
  prefix: {cls: true}
  position: learned
  width: 32
  depth: 2
  block: {heads: 2}
head: {kind: classifier, classes: 4}
"""


def _quadrant_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images with a bright 4x4 square in one quadrant; the class is the quadrant."""
    labels = torch.randint(0, 4, (n,), generator=gen)
    x = 0.3 * torch.randn(n, 1, 16, 16, generator=gen)
    for i, label in enumerate(labels.tolist()):
        r = (label // 2) * 8 + int(torch.randint(0, 5, (1,), generator=gen))
        c = (label % 2) * 8 + int(torch.randint(0, 5, (1,), generator=gen))
        x[i, 0, r : r + 4, c : c + 4] += 1.5
    return x, labels


def test_vit_learns_a_synthetic_image_task() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = specvit.build_model(specvit.parse_spec(VIT))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(200):
        x, y = _quadrant_batch(64, gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    x, y = _quadrant_batch(512, gen)
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
    assert accuracy >= 0.95, accuracy


LM = """specvit: 1
name: counter
model: decoder
decoder:
  input: {kind: tokens, vocab: 16}
  position: rope
  width: 32
  depth: 2
  block: {heads: 4, layers: [masked_self_attention, mlp], norm: {kind: rmsnorm}, mlp: {activation: swiglu}}
head: {kind: lm, tied: true}
"""


def test_decoder_learns_a_deterministic_sequence() -> None:
    """Each sequence counts up by a step fixed by its first two tokens: t[i+1] = t[i] + (t[1] - t[0]) mod 16."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = specvit.build_model(specvit.parse_spec(LM))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(n: int) -> torch.Tensor:
        start = torch.randint(0, 16, (n, 1), generator=gen)
        step = torch.randint(1, 4, (n, 1), generator=gen)
        return (start + step * torch.arange(12)) % 16

    for _ in range(300):
        seq = batch(64)
        loss = F.cross_entropy(model(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    seq = batch(256)
    out = model.generate(seq[:, :2], 10)
    accuracy = (out[:, 2:] == seq[:, 2:]).float().mean().item()
    assert accuracy >= 0.99, accuracy


SEGMENTS = {  # seven-segment digits: a b c d e f g (top, top-right, bottom-right, bottom, bottom-left, top-left, middle)
    0: "abcdef",
    1: "bc",
    2: "abdeg",
    3: "abcdg",
    4: "bcfg",
    5: "acdfg",
    6: "acdefg",
    7: "abc",
    8: "abcdefg",
    9: "abcdfg",
}


def _templates() -> torch.Tensor:
    """(10, 28, 28) seven-segment digits drawn in a 10 x 16 box, centred as MNIST centres its digits."""
    top, left, w, h, wd = 6, 9, 3, 16, 10
    bars = {
        "a": (top, top + w, left, left + wd),
        "d": (top + h - w, top + h, left, left + wd),
        "g": (top + h // 2 - 1, top + h // 2 - 1 + w, left, left + wd),
        "f": (top, top + h // 2, left, left + w),
        "b": (top, top + h // 2, left + wd - w, left + wd),
        "e": (top + h // 2, top + h, left, left + w),
        "c": (top + h // 2, top + h, left + wd - w, left + wd),
    }
    out = torch.zeros(10, 28, 28)
    for digit, segments in SEGMENTS.items():
        for seg in segments:
            r0, r1, c0, c1 = bars[seg]
            out[digit, r0:r1, c0:c1] = 1.0
    return out


def _digits(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic MNIST: seven-segment digits shifted by up to a pixel, scaled, with noise."""
    labels = torch.randint(0, 10, (n,), generator=gen)
    shifts = torch.randint(-1, 2, (n, 2), generator=gen).tolist()
    images = torch.stack(
        [t.roll((dy, dx), dims=(0, 1)) for t, (dy, dx) in zip(_templates()[labels], shifts, strict=True)]
    )
    scale = 0.7 + 0.6 * torch.rand(n, 1, 1, generator=gen)
    images = images * scale + 0.2 * torch.randn(n, 28, 28, generator=gen)
    return images[:, None], labels  # (n, 1, 28, 28)


def test_mnist_pair_differs_only_in_norm_placement() -> None:
    pre, post = (specvit.load_spec(ROOT / "specs" / f"{p}.yaml") for p in ("mnist_vit", "mnist_vit_postnorm"))
    assert pre.encoder is not None and post.encoder is not None
    assert (pre.encoder.block.norm.placement, post.encoder.block.norm.placement) == ("pre", "post")
    pre.encoder.block.norm.placement = "post"
    assert pre.model_dump(exclude={"name", "description"}) == post.model_dump(exclude={"name", "description"})


@pytest.mark.parametrize(
    "preset", ["mnist_vit", "mnist_vit_postnorm"], ids=["pre-norm (vit)", "post-norm (original)"]
)
def test_mnist_vit_pair_learns_synthetic_digits(preset: str) -> None:
    """The tutorial's ViT in both norm placements learns the synthetic digits (chance is 0.1).

    200 steps of AdamW give about 0.88 (pre-norm) and 0.69 (post-norm) here: the post-norm original trains
    more slowly without warm-up, as Xiong et al. (2020) describe.
    """
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = specvit.build_model(ROOT / "specs" / f"{preset}.yaml")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    for _ in range(200):
        x, y = _digits(64, gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    x, y = _digits(500, gen)
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
    assert accuracy >= 0.6, accuracy
