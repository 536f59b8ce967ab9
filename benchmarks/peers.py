"""Peer rows of issue #29's cores beyond plain attention: the mixture-of-experts MLP against HF Mixtral's
sparse MoE block (eval forward and an AdamW training step), and Swin-T's windowed attention against timm's
Swin-T. Each specvit side carries its peer's weights, converted by specvit's importers, and the outputs (and
the MoE's gradients) are asserted equal before anything is timed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from benchmarks.common import Row, target, timeit_pair
from benchmarks.training import step_fn

if TYPE_CHECKING:
    from specvit.spec import Spec

__all__ = ["MoePair", "moe_pair", "moe_rows", "swin_pair", "swin_rows"]

TOL = 1e-4  # the outputs' max abs difference each row asserts before timing


def _tag(smoke: bool) -> str:
    return " [smoke size]" if smoke else ""


@dataclass
class MoePair:
    """specvit's MoE MLP (its router and experts) and HF's Mixtral block, on the same weights and input.

    Args:
        router: specvit's router, D -> E logits.
        experts: specvit's :class:`~specvit.nn.moe.MoeMlp`.
        peer: HF's ``MixtralSparseMoeBlock``.
        peer_name: the peer and the experts implementation HF chose for it.
        x: (B, N, D) tokens.
        flops: one forward's: the router and the k experts each token runs.
        size: the case in words.
    """

    router: nn.Module
    experts: nn.Module
    peer: nn.Module
    peer_name: str
    x: Tensor
    flops: int
    size: str

    def ours(self, x: Tensor) -> Tensor:
        """specvit's MoE MLP on x: (B, N, D), as its compiled block runs it: router, then the experts."""
        return self.experts(x, logits=self.router(x))


def moe_pair(smoke: bool) -> MoePair:
    """A one-layer Mixtral from HF (random weights, HF's default experts implementation), read by
    ``specvit.from_hf``, its weights converted; specvit's MoE MLP of the model and HF's block of the layer.

    Args:
        smoke: toy sizes (4 experts of width 64 over 32 wide tokens, batch 2 x 16) to check the code.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    import specvit

    dim, hidden, experts, top_k, b, n = (32, 64, 4, 2, 2, 16) if smoke else (512, 1024, 8, 2, 4, 256)
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=max(1, dim // 64),  # the attention is built, converted and never run
        num_key_value_heads=max(1, dim // 64),
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    torch.manual_seed(0)
    hf = MixtralForCausalLM(config)
    spec = specvit.from_hf(hf)
    model = specvit.build_model(spec)
    model.load_state_dict(specvit.convert_state_dict(hf.state_dict(), "hf", spec), strict=True)
    tokens = b * n
    # per token: the router (D x E) and k experts of [gate; value] D x 2F and down F x D, 2 FLOPs a MAC
    flops = 2 * tokens * dim * (experts + top_k * 3 * hidden)
    return MoePair(
        router=model.get_submodule("decoder.blocks.0.router"),
        experts=model.get_submodule("decoder.blocks.0.mlp"),
        peer=hf.model.layers[0].mlp,
        peer_name=f"HF MixtralSparseMoeBlock ({hf.config._experts_implementation})",
        x=torch.randn(b, n, dim),
        flops=flops,
        size=f"{experts} experts, top {top_k}, width {dim}, expert hidden {hidden}, batch {b} x {n} tokens",
    )


def _no_slower(row: Row, met: bool) -> None:
    target(f"{row.section} no slower than {row.peer_name}", met, f"ratio {row.ratio()}")


def _grad_diff(pair: MoePair) -> float:
    """Max abs difference of the two sides' gradients of the same loss, every weight matched to HF's."""
    ours = pair.ours(pair.x).square().mean()
    theirs = pair.peer(pair.x).square().mean()
    (ours + theirs).backward()
    matched = (
        (pair.router.get_parameter("weight"), pair.peer.get_parameter("gate.weight")),
        (pair.experts.get_parameter("fc1"), pair.peer.get_parameter("experts.gate_up_proj")),
        (pair.experts.get_parameter("fc2"), pair.peer.get_parameter("experts.down_proj")),
    )
    diff = max((a.grad - b.grad).abs().max().item() for a, b in matched)  # type: ignore[operator]
    for module in (pair.router, pair.experts, pair.peer):
        module.zero_grad(set_to_none=True)
    return diff


def moe_rows(repeat: int, smoke: bool = False) -> list[Row]:
    """The MoE MLP's eval forward and training step (AdamW) against HF Mixtral's block, same weights."""
    pair = moe_pair(smoke)
    section = "Mixture-of-experts MLP (Mixtral's)"
    ours_modules = nn.ModuleList([pair.router, pair.experts])
    for module in (ours_modules, pair.peer):
        module.eval()
    with torch.inference_mode():
        diff = (pair.ours(pair.x) - pair.peer(pair.x)).abs().max().item()
        assert diff < TOL, f"the MoE MLP differs from HF Mixtral's by {diff}"
        t_ours, t_peer = timeit_pair(lambda: pair.ours(pair.x), lambda: pair.peer(pair.x), repeat)
    forward = Row(
        f"{section}, eval forward" + _tag(smoke),
        f"{pair.size}; max abs diff {diff:.1e}",
        t_ours,
        t_peer,
        pair.peer_name,
        pair.flops,
    )
    _no_slower(forward, t_ours <= t_peer)
    for module in (ours_modules, pair.peer):
        module.train()
    grad = _grad_diff(pair)
    assert grad < TOL, f"the MoE MLP's gradients differ from HF Mixtral's by {grad}"
    steps = (
        step_fn(ours_modules, lambda: pair.ours(pair.x).square().mean()),
        step_fn(pair.peer, lambda: pair.peer(pair.x).square().mean()),
    )
    t_ours, t_peer = timeit_pair(*steps, repeat)
    train = Row(
        f"{section}, training step (AdamW)" + _tag(smoke),
        f"{pair.size}; loss mean(y^2); max abs diff of the gradients {grad:.1e}",
        t_ours,
        t_peer,
        pair.peer_name,
        3 * pair.flops,
    )
    _no_slower(train, t_ours <= t_peer)
    return [forward, train]


def swin_pair(smoke: bool) -> tuple[nn.Module, nn.Module, Spec]:
    """specvit's Swin-T from its preset and timm's ``swin_tiny_patch4_window7_224`` with the same weights:
    timm's random init moved off by N(0, 0.02) (zero biases and unit norms would hide a wrong mapping),
    converted by ``convert_state_dict(..., "timm", spec)``.

    Args:
        smoke: Swin-T's stages at width 16 (heads 1, 2, 4, 8) and 2 blocks each, at 224 pixels.

    Returns:
        specvit's model, timm's, and the spec (for its FLOPs).
    """
    import timm

    import specvit

    name = "swin_tiny_patch4_window7_224"
    overrides: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    if smoke:
        overrides = {"encoder.width": 16, "encoder.block.heads": [1, 2, 4, 8], "encoder.depth": [2, 2, 2, 2]}
        kwargs = {"embed_dim": 16, "num_heads": (1, 2, 4, 8), "depths": (2, 2, 2, 2)}
    spec = specvit.load_spec(name, overrides=overrides)
    torch.manual_seed(0)
    peer = timm.create_model(name, pretrained=False, **kwargs).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in peer.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    ours = specvit.build_model(spec).eval()
    ours.load_state_dict(specvit.convert_state_dict(peer.state_dict(), "timm", spec), strict=True)
    return ours, peer, spec


def swin_rows(repeat: int, smoke: bool = False) -> list[Row]:
    """Swin-T's eval forward (shifted-window attention with relative position bias) against timm's."""
    import specvit

    ours, peer, spec = swin_pair(smoke)
    batch = 2 if smoke else 8
    x = torch.randn(batch, 3, 224, 224)
    with torch.inference_mode():
        diff = (ours(x) - peer(x)).abs().max().item()
        assert diff < TOL, f"Swin-T differs from timm's by {diff}"
        t_ours, t_peer = timeit_pair(lambda: ours(x), lambda: peer(x), repeat)
    size = "width 16, heads 1/2/4/8, 2 blocks a stage, " if smoke else ""
    row = Row(
        "Swin-T forward (windowed attention), eval" + _tag(smoke),
        f"{size}batch {batch}, 224 pixels; max abs diff of the logits {diff:.1e}",
        t_ours,
        t_peer,
        "timm swin_tiny_patch4_window7_224",
        specvit.build_graph(spec, batch=batch).total_flops,
    )
    target(f"{row.section} no slower than timm", t_ours <= t_peer, f"ratio {row.ratio()}")
    return [row]
