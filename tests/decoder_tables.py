"""The checks a decoder family's table must pass, shared by the test files of the decoder tables: HF's logits
(fp32, <= 1e-4) and greedy tokens, each read field moving HF's output as specvit's, the class defaults, and
unread fields refused. A family's case: (config class, model class, config fields, [(field, another value[,
the base's other fields])])."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from reference import check_refused, check_table_defaults, converted, hf_noised, unswitched
from torch import nn

import specvit
from specvit.interop.table import TABLES, F, Table

VOCAB, N, ATOL, NOISE = 97, 16, 1e-4, 0.08
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=None)  # no end token: HF would hold it back
SIZES = dict(
    vocab_size=VOCAB, num_hidden_layers=2, hidden_size=48, num_attention_heads=4, intermediate_size=40
)
THETA = {"rope_type": "default", "rope_theta": 50.0}
GQA = SIZES | dict(num_key_value_heads=2, head_dim=12)
"""Grouped keys and values, and a head width other than width / heads."""
LLAMA_SWITCHES = [("num_key_value_heads", 4), ("rms_norm_eps", 0.3), ("hidden_act", "gelu"), ("head_dim", 8),
                  ("rope_parameters", THETA), ("tie_word_embeddings", True)]  # fmt: skip
"""The fields of Llama's attention and MLP a Llama-like table reads, each with a value that moves the output."""

Case = tuple[str, str, dict[str, Any], list[tuple[Any, ...]]]
Read = Callable[[nn.Module], Any]
"""What ``from_hf`` is given of HF's model: the model itself (its class read too), or its config."""


def whole(ref: nn.Module) -> Any:
    return ref


def table(family: str) -> Table:
    import specvit.interop.hf  # noqa: F401  (registers every family)

    return TABLES[family]


def hf(case: Case, seed: int = 0, **change: Any) -> nn.Module:
    """HF's model of a case, its fields changed, every weight and buffer moved by N(0, 0.08)."""
    import transformers

    config_name, model_name, kw, _ = case
    fields = copy.deepcopy(kw | IDS | change)  # a config class may write into a dict it is given
    return hf_noised(model_name, getattr(transformers, config_name)(**fields), seed, NOISE)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(seed))


def logits(ref: nn.Module, read: Read = whole) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's logits (through from_hf(read(model)) and the converter; an MoE's beside its router loss) and
    HF's, on the same tokens."""
    model = converted(ref, specvit.from_hf(read(ref)))
    with torch.no_grad():
        ours = model(tokens())
        return ours["logits"] if isinstance(ours, dict) else ours, ref(input_ids=tokens()).logits


def check_parity(ref: nn.Module, read: Read = whole) -> None:
    """The same logits and the same 12 greedy tokens (none a degenerate repeat) as HF."""
    ours, theirs = logits(ref, read)
    assert (ours - theirs).abs().max().item() <= ATOL
    model = converted(ref, specvit.from_hf(read(ref)))
    prompt = tokens(2)[:, :4]
    with torch.no_grad():
        got = model.generate(prompt, 12)
        want = ref.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
        )
    assert torch.equal(got, want)
    assert any(len(set(row[4:].tolist())) > 1 for row in got)


def check_switch(
    case: Case, field: str | tuple[str, ...], value: Any, others: dict[str, Any], read: Read = whole
) -> None:
    """The field switched (or several, to values given as a tuple): specvit follows HF, and HF's output moved
    (the control)."""
    change = dict(zip(field, value, strict=True)) if isinstance(field, tuple) else {field: value}
    ref = hf(case, **(others | change))
    ours, theirs = logits(ref, read)
    assert (ours - theirs).abs().max().item() <= ATOL
    key = repr((case[:3], others))
    if key not in _BEFORE:  # HF's logits of the base, computed once for every field switched from it
        with torch.no_grad():
            _BEFORE[key] = hf(case, **others)(input_ids=tokens()).logits
    before = _BEFORE[key]
    assert before.shape == theirs.shape
    assert (before - theirs).abs().max().item() > 10 * ATOL


_BEFORE: dict[str, torch.Tensor] = {}


def check_switched(family: str, case: Case, *exempt: set[str]) -> None:
    """Every config field the family's table reads is switched by a case, but those ``exempt``."""
    switched = {
        f for switch in case[3] for f in (switch[0] if isinstance(switch[0], tuple) else (switch[0],))
    }
    untested = unswitched(table(family), switched, *exempt)
    assert not untested, f"{family}: fields read but never switched: {untested}"


def check_defaults(family: str, case: Case) -> None:
    """Each field's default is the class's, and a config of the model type alone is the class's defaults."""
    import transformers

    assert any(isinstance(v, F) and v.default is not None for v in table(family).entries().values())
    check_table_defaults(table(family), case[0], family, whole=False)
    assert dump({"model_type": family}) == dump(getattr(transformers, case[0])())


def dump(config: Any) -> dict[str, Any]:
    """The spec of a config as data, kv_heads written as null where it equals heads."""
    data = specvit.from_hf(config).model_dump(exclude={"description"})
    block = data["decoder"]["block"]
    if block["kv_heads"] == block["heads"]:
        block["kv_heads"] = None
    return data


def check_unread(family: str, case: Case) -> None:
    """A field no table reads is refused, naming it."""
    message = f"config.clip_logits: {family} config has clip_logits=4.0: specvit's"
    check_refused(hf(case).config.to_dict(), {"clip_logits": 4.0}, message)


def check_round_trip(ref: nn.Module, directory: Path) -> None:
    """HF -> specvit -> HF: ``to_hf``'s directory loads as the original's class with its logits; a weight
    changed in specvit comes back changed (the control)."""
    import transformers

    ours = converted(ref, specvit.from_hf(ref))
    specvit.to_hf(ours, directory / "back")
    config = json.loads((directory / "back" / "config.json").read_text())
    back = getattr(transformers, config["architectures"][0]).from_pretrained(directory / "back").eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        want = ref(input_ids=tokens()).logits
        assert (back(input_ids=tokens()).logits - want).abs().max().item() <= 1e-5
        weight = ours.decoder.blocks[1].attn.proj.weight  # not a constant, which a LayerNorm would remove
        weight.add_(0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    specvit.to_hf(ours, directory / "changed")
    changed = getattr(transformers, config["architectures"][0]).from_pretrained(directory / "changed").eval()
    with torch.no_grad():
        assert (changed(input_ids=tokens()).logits - want).abs().max().item() > 10 * ATOL
