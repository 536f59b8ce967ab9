"""Mixture-of-experts MLPs (``mlp.moe``) against HF's Mixtral and Qwen2-MoE in float64: the logits, the
routing (softmax, top-k, renormalised or not), the shared expert and its gate, dense layers beside MoE
ones, and the load-balancing loss the model outputs as ``router_loss``. FLOPs count the active experts
and equal what ``FlopCounterMode`` measures; the model decodes and ejects like any other."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import float64_reference
from test_constructs import TOL, VOCAB, N, Rename, _decoder, _hf, _llama_keys, _ours
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from specvit.compile import build_graph, build_model, eject
from specvit.diagram.text import format_table
from specvit.errors import SpecError
from specvit.model import SpecModel
from specvit.nn.moe import expert_products
from specvit.spec.loader import parse_spec

E, K = 4, 2
LOSS_TOL = 1e-7  # HF divides its token counts in float32: 2.2e-9 (Mixtral), 2.5e-8 (Qwen2-MoE) off float64


def _moe_keys() -> Rename:
    layer = r"model.layers.{0}.mlp."
    return [
        (r"decoder\.blocks\.(\d+)\.router\.weight", layer + "gate.weight"),
        (r"decoder\.blocks\.(\d+)\.mlp\.fc1", layer + "experts.gate_up_proj"),
        (r"decoder\.blocks\.(\d+)\.mlp\.fc2", layer + "experts.down_proj"),
        (
            r"decoder\.blocks\.(\d+)\.mlp\.shared\.fc1\.weight",
            (layer + "shared_expert.gate_proj.weight", layer + "shared_expert.up_proj.weight"),
        ),
        (r"decoder\.blocks\.(\d+)\.mlp\.shared\.fc2\.weight", layer + "shared_expert.down_proj.weight"),
        (r"decoder\.blocks\.(\d+)\.mlp\.shared_gate\.weight", layer + "shared_expert_gate.weight"),
        (
            r"decoder\.blocks\.(\d+)\.attn\.qkv\.bias",
            tuple(r"model.layers.{0}.self_attn." + f"{c}_proj.bias" for c in "qkv"),
        ),
        *_llama_keys(),
    ]


def _block(eps: float = 1e-6, **moe: Any) -> dict[str, Any]:
    return {
        "heads": 4,
        "kv_heads": 2,
        "norm": {"kind": "rmsnorm", "eps": eps},
        "qkv_bias": False,
        "proj_bias": False,
        "mlp": {
            "hidden": 40,
            "activation": "swiglu",
            "bias": False,
            "moe": {"experts": E, "top_k": K, **moe},
        },
    }


def _compare(model: SpecModel, ref: nn.Module) -> tuple[float, float]:
    """Max abs difference of the logits, and of the load-balancing loss."""
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        with float64_reference():
            theirs = ref(ids, output_router_logits=True)
    logits = (ours["logits"] - theirs.logits).abs().max().item()
    return logits, (ours["router_loss"] - theirs.aux_loss).abs().item()


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40)
    moe = dict(num_local_experts=E, num_experts_per_tok=K, experts_implementation="eager")  # not grouped_mm
    return _hf(MixtralConfig, MixtralForCausalLM, 7, **moe, **kw)


def test_mixtral_routes_and_balances_as_hf() -> None:
    ref = _mixtral()
    logits, loss = _compare(
        _ours(_decoder(_block(1e-5), {"kind": "rope", "base": 1e6}, 48), ref, _moe_keys()), ref
    )
    assert logits <= TOL and loss <= LOSS_TOL

    # the control: Mixtral renormalises the top-k weights; without it the logits differ
    control = _ours(
        _decoder(_block(1e-5, normalize=False), {"kind": "rope", "base": 1e6}, 48), ref, _moe_keys()
    )
    with pytest.raises(AssertionError):
        assert _compare(control, ref)[0] <= TOL


def test_padding_routes_nowhere_in_the_load_balancing_loss() -> None:
    """With a padding mask the router loss counts the real tokens only, as HF's ``load_balancing_loss_func``
    with the ``attention_mask``; the control, the same call without the mask, counts the padding too."""
    ref = _mixtral()
    model = _ours(_decoder(_block(1e-5), {"kind": "rope", "base": 1e6}, 48), ref, _moe_keys())
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[0, :3] = True  # left padding of the first row
    with torch.no_grad():
        ours, control = model(ids, key_padding_mask=pad)["router_loss"], model(ids)["router_loss"]
        with float64_reference():
            theirs = ref(ids, attention_mask=(~pad).long(), output_router_logits=True).aux_loss
    assert (ours - theirs).abs().item() <= LOSS_TOL
    assert (control - theirs).abs().item() > LOSS_TOL


def _qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    kw = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40)
    moe = dict(
        num_experts=E, num_experts_per_tok=K, moe_intermediate_size=40, shared_expert_intermediate_size=24
    )
    moe |= {"experts_implementation": "eager"}  # HF's loop over experts: its grouped_mm takes no float64
    return _hf(Qwen2MoeConfig, Qwen2MoeForCausalLM, 8, mlp_only_layers=[0], **kw, **moe)


def _qwen2_moe_spec(gate: bool) -> dict[str, Any]:
    block = _block(normalize=False, shared_hidden=24, shared_gate=gate) | {"qkv_bias": True}
    spec = _decoder(block, {"kind": "rope"}, 48)
    dense = {"mlp": {"moe": None}}  # mlp_only_layers: [0]
    spec["decoder"]["overrides"] = [{"layers": [0], "block": dense}]
    return spec


def test_qwen2_moe_shared_expert_and_dense_layers_are_hfs() -> None:
    ref = _qwen2_moe()
    model = _ours(_qwen2_moe_spec(gate=True), ref, _moe_keys())
    assert not hasattr(model.decoder.blocks[0], "router")  # the dense layer has no router
    logits, loss = _compare(model, ref)
    assert logits <= TOL and loss <= LOSS_TOL

    # the control: the shared expert without its sigmoid gate
    control = _ours(_qwen2_moe_spec(gate=False), ref, _moe_keys(), strict=False)
    with pytest.raises(AssertionError):
        assert _compare(control, ref)[0] <= TOL


def test_flops_count_the_active_experts_as_measured() -> None:
    spec = parse_spec(_decoder(_block(shared_hidden=24, shared_gate=True), {"kind": "rope"}, 48))
    graph = build_graph(spec, batch=2, seq_len=N)
    model = build_model(graph).eval()
    node = graph["decoder.blocks.0.mlp"]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.decoder.blocks[0].mlp(torch.randn(2, N, 48), logits=torch.randn(2, N, E))
    assert node["flops"] == counter.get_total_flops()
    dense = 2 * 2 * N * (48 * 80 + 40 * 48)  # one expert's FLOPs on every token
    assert node["flops"] < E * dense  # not all experts
    assert "FLOPs of 2 active" in " ".join(graph.op("decoder.blocks.0.mlp").label(node["p"]))
    table = format_table(graph)
    assert "FLOPs count the 2 of 4 experts each token runs and the shared expert" in table
    dense = build_graph(parse_spec(_decoder({"heads": 4}, {"kind": "rope"}, 48)), batch=2, seq_len=N)
    assert "experts each token runs" not in format_table(dense)


def test_an_moe_model_decodes_and_ejects() -> None:
    spec = parse_spec(_decoder(_block(shared_hidden=24), {"kind": "rope"}, 48))
    torch.manual_seed(0)
    model = build_model(spec).eval()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    cached = model.generate(prompt, 6)
    assert cached.equal(model.generate(prompt, 6, use_cache=False))
    graph = build_graph(spec, batch=2, seq_len=N)
    namespace: dict[str, Any] = {"__name__": "ejected"}
    exec(compile(eject(graph), "<ejected>", "exec"), namespace)
    ejected = namespace["Model"]().eval()
    ejected.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours, theirs = model(prompt), ejected(prompt)
    assert (ours["logits"] - theirs["logits"]).abs().max().item() == 0.0
    assert ours["router_loss"].item() == theirs["router_loss"].item()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"top_k": 5}, r"decoder\.block\.mlp\.moe\.top_k: top_k 5 is more than the 4 experts"),
        (
            {"shared_gate": True},
            r"decoder\.block\.mlp\.moe\.shared_gate: shared_gate gates the shared expert",
        ),
    ],
)
def test_moe_settings_that_cannot_hold_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(_decoder(_block(**change), {"kind": "rope"}, 48))


def test_moe_layers_of_one_model_route_alike() -> None:
    spec = _decoder(_block(), {"kind": "rope"}, 48)
    spec["decoder"]["overrides"] = [{"layers": [1], "block": {"mlp": {"moe": {"experts": 8}}}}]
    with pytest.raises(SpecError, match=r"overrides\.0\.block\.mlp\.moe: 8 experts, top 2 here, 4, top 2 at"):
        parse_spec(spec)


def test_each_expert_is_initialised_as_one_linear_layer() -> None:
    """Under the xavier convention an expert's (F, D) matrix gets xavier's scale for its own fans, not the
    scale of one (E, F * D) matrix (std 0.023 here)."""
    spec = _decoder(_block(), {"kind": "rope"}, 48) | {"init": "xavier"}
    torch.manual_seed(0)
    mlp = build_model(parse_spec(spec)).decoder.blocks[0].mlp
    for weight, (out, inp) in ((mlp.fc1, (80, 48)), (mlp.fc2, (48, 40))):
        assert abs(weight.std().item() / (2 / (out + inp)) ** 0.5 - 1) < 0.05


def test_an_moe_mlp_in_a_block_graph_names_its_router_beside_it() -> None:
    """A graph node ``ffn`` of op mlp gets ``ffn_router`` and ``ffn_router_stats`` beside it (not ``ffn``
    again) and computes what the same block written as layers computes."""
    layers = _decoder(_block(), {"kind": "rope"}, 48)
    graph = _decoder(_block(), {"kind": "rope"}, 48)
    graph["decoder"]["block"]["graph"] = [
        {"name": "norm1", "op": "norm", "inputs": ["x"]},
        {"name": "attn", "op": "masked_self_attention", "inputs": ["norm1"]},
        {"name": "add1", "op": "add", "inputs": ["x", "attn"]},
        {"name": "norm2", "op": "norm", "inputs": ["add1"]},
        {"name": "ffn", "op": "mlp", "inputs": ["norm2"]},
        {"name": "add2", "op": "add", "inputs": ["add1", "ffn"]},
    ]
    torch.manual_seed(0)
    ours = build_model(parse_spec(layers)).eval()
    written = build_model(parse_spec(graph)).eval()
    rename = {"router.": "ffn_router.", "mlp.": "ffn."}
    state = {}
    for key, value in ours.state_dict().items():
        for old, new in rename.items():
            key = key.replace(f".{old}", f".{new}")
        state[key] = value
    written.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours(ids), written(ids)
    assert a["logits"].equal(b["logits"]) and a["router_loss"].equal(b["router_loss"])


def _expert_products_run(k: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict[Any, int]]:
    """``expert_products`` of 10 rows of width ``k`` over 4 experts (one with no rows), forward and backward
    under ``FlopCounterMode``: the output and both gradients, and the FLOPs counted per op."""
    torch.manual_seed(0)
    x = torch.randn(10, k, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(E, 24, k, dtype=torch.float64).to(dtype).requires_grad_()
    with FlopCounterMode(display=False) as counter:
        out = expert_products(x, weight, [3, 0, 5, 2])
        out.backward(torch.ones_like(out))
    assert x.grad is not None and weight.grad is not None
    return [out.detach(), x.grad, weight.grad], counter.get_flop_counts().get("Global", {})


@pytest.mark.parametrize("k", [16, 6])
def test_expert_products_equal_a_product_per_expert_and_count_their_flops(k: int) -> None:
    """One grouped product where the rows are 16-byte multiples (k = 16), a product per expert elsewhere:
    the same values and gradients as each expert's ``F.linear`` in float64, and FLOPs counted as torch
    counts those products (forward, and the inputs' and weights' gradients: 3 x 2 x S x K x N)."""
    got, flops = _expert_products_run(k, torch.float32)
    want, _ = _expert_products_run(k, torch.float64)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    assert (torch.ops.aten._grouped_mm in flops) == (k == 16), flops
    assert sum(flops.values()) == 3 * 2 * 10 * k * 24


def test_grouped_products_count_nothing_without_specvit_s_flop_formula(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control of the FLOPs above: torch has no formula for ``aten._grouped_mm`` of its own."""
    monkeypatch.delitem(flop_registry, torch.ops.aten._grouped_mm)
    _, flops = _expert_products_run(16, torch.float32)
    assert sum(flops.values()) != 3 * 2 * 10 * 16 * 24
