"""The task classes of every decoder family a table reads: ``*ForSequenceClassification`` (a linear layer without
bias on the last token that is not padding) and ``*ForTokenClassification`` (a linear layer with a bias on every
token), where transformers has them, against transformers (fp32, <= 1e-4, N(0, 0.08) on every weight and buffer)
on a batch whose second row is right-padded. The causal LM and base classes are tested with each family's fields
in tests/test_hf_tables.py and tests/test_hf_decoder_tables2.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_hf_decoder_tables2 as more
import test_hf_tables as llama_like
import torch
from reference import converted, hf_config, hf_noised
from torch import nn

import specvit
from specvit.interop.table import TABLES
from specvit.model import logits_of

VOCAB, N, ATOL, PAD = 97, 16, 1e-4, 0
LABELS = {"id2label": {str(i): f"L{i}" for i in range(3)}}

CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("Llama", "LlamaConfig", llama_like.SMALL | dict(num_key_value_heads=2)),
    "mistral": ("Mistral", "MistralConfig", llama_like.SMALL | dict(num_key_value_heads=2, sliding_window=5)),
    **{f: (TABLES[f].name, case[0], llama_like.SMALL | case[2]) for f, case in llama_like.CASES.items()},
    **{f: (TABLES[f].name, case[0], case[2]) for f, case in more.CASES.items()},
}
"""Family -> (HF class prefix, config class, config fields): the cases of the families' own tests."""

CASES = [
    (family, suffix)
    for family, (prefix, _, _) in CONFIGS.items()
    for suffix in ("ForSequenceClassification", "ForTokenClassification")
    if suffix in TABLES[family].classes
]


def _hf(family: str, suffix: str) -> nn.Module:
    import transformers

    prefix, config_class, fields = CONFIGS[family]
    ids = llama_like.IDS | {"pad_token_id": PAD}
    config = getattr(transformers, config_class)(**(fields | ids | LABELS))
    return hf_noised(prefix + suffix, config, seed=3)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (none the pad id) and padding: the second row is 11 tokens long, padded with the pad id."""
    ids = torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros_like(ids, dtype=torch.bool)
    pad[1, 11:] = True
    return ids.masked_fill(pad, PAD), pad


def test_every_class_transformers_has_is_read() -> None:
    """The decoder families' classes are those transformers has (Cohere and OLMo have no token classifier)."""
    import transformers

    for family, (prefix, _, _) in CONFIGS.items():
        for suffix in ("ForSequenceClassification", "ForTokenClassification"):
            assert (suffix in TABLES[family].classes) == hasattr(transformers, prefix + suffix), (
                family,
                suffix,
            )
    assert len(CASES) >= 30


@pytest.mark.parametrize(("family", "suffix"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_each_decoder_task_class_is_transformers(family: str, suffix: str) -> None:
    ref = _hf(family, suffix)
    spec = specvit.from_hf(hf_config(ref))
    model = converted(ref, spec)
    ids, pad = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=(~pad).long()).logits
        ours = logits_of(model(ids, key_padding_mask=pad))  # Mixtral's beside its router loss
    if suffix == "ForSequenceClassification":
        assert (spec.head.kind, spec.head.pool, spec.head.classes, spec.head.bias) == (
            "classifier",
            "last",
            3,
            False,
        )
        assert ours.shape == theirs.shape == (2, 3)
        with torch.no_grad():  # the control: the last token of the padded row, padding or not
            assert (logits_of(model(ids)) - theirs)[1].abs().max().item() > 10 * ATOL
    else:
        assert (spec.head.kind, spec.head.vocab, spec.head.bias, spec.head.tied) == ("lm", 3, True, False)
        assert ours.shape == theirs.shape == (2, N, 3)
        keep = ~pad  # HF's rows at padded queries see only padding keys: not defined
        ours, theirs = ours[keep], theirs[keep]
        assert model.head.fc.bias.abs().max().item() > 10 * ATOL  # the control: the head's own bias is read
    assert (ours - theirs).abs().max().item() <= ATOL
