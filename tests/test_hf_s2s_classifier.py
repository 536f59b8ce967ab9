"""The encoder-decoders' sequence classifiers (BART's, mBART's, T5's, mT5's ``*ForSequenceClassification``), each
a class of its family's table: given ``input_ids`` alone, HF's decoder reads them shifted right behind a start id
(mBART's: behind the last token that is not padding), and the head reads the decoder's token at the source's
last ``eos_token_id`` through dense, tanh and out_proj. specvit states both as data (``decoder.input.
shifted_source``, ``pool: last_eos``), so ``model(src)`` is HF's ``model(input_ids)``: the same logits (fp32,
<= 1e-4, N(0, 0.08) noise on every weight) on padded batches of odd length with several eos per row; each field
the class reads switched (HF's output moves, specvit's follows); the pieces that make it exact switched off one
at a time (the controls); ``to_hf`` back to the class transformers loads.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import check_refused, converted, hf_config, hf_model, noised
from test_hf_encdec_tables import BART_IDS, BART_SIZES, T5_SIZES
from torch import nn

import specvit
from specvit.errors import SpecError
from specvit.interop.hf import spec_dict
from specvit.nn.functional import eos_pool, shift_right
from specvit.spec.loader import parse_spec

VOCAB, S, ATOL = 97, 13, 1e-4
BART = BART_SIZES | BART_IDS | dict(num_labels=3)
T5 = T5_SIZES | dict(num_labels=3)
CASES = {"bart": ("Bart", BART), "mbart": ("MBart", BART), "t5": ("T5", T5), "mt5": ("MT5", T5)}
SWITCHES: dict[str, list[dict[str, Any]]] = {
    "bart": [{"eos_token_id": 5}, {"decoder_start_token_id": 7}, {"num_labels": 5}],
    "mbart": [{"eos_token_id": 5}, {"pad_token_id": 6}],  # mBART's start: the last token that is not pad
    "t5": [{"eos_token_id": 5}, {"decoder_start_token_id": 7}, {"num_labels": 1}],
    "mt5": [{"eos_token_id": 5}, {"decoder_start_token_id": 7}],
}


def _hf(family: str, seed: int = 0, **change: Any) -> nn.Module:
    import transformers

    prefix, sizes = CASES[family]
    config = getattr(transformers, prefix + "Config")(**(sizes | change))
    return noised(hf_model(prefix + "ForSequenceClassification", config, seed), seed, 0.08, frozen=False)


def _ids(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sources of 13 tokens (no special id but where placed), two eos each at other places (HF needs as many
    in each row), the first ending in a token after its last eos (mBART's language id), the second right-padded
    after its last eos (with the class's default pad id, whichever a config names); and HF's attention mask."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(8, VOCAB, (2, S), generator=gen)
    eos, pad = config.eos_token_id, 1 if config.model_type in ("bart", "mbart") else 0  # the classes' pad ids
    src[0, [4, 11]] = eos
    src[1, [2, 8]] = eos
    src[1, 9:] = pad
    return src, (src != pad).long()


def _run(ref: nn.Module, spec: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """specvit's logits (of ``spec``, by default the one from_hf makes) and HF's, on the padded batch."""
    model = converted(ref, spec or specvit.from_hf(hf_config(ref)))
    src, mask = _ids(ref.config)
    with torch.no_grad():
        return model(src, src_key_padding_mask=mask == 0), ref(input_ids=src, attention_mask=mask).logits


def _edited(ref: nn.Module, **changes: Any) -> Any:
    """The spec from_hf makes of ``ref``, with dotted keys changed (a control)."""
    data = spec_dict(hf_config(ref))
    for key, value in changes.items():
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[last] = value
    return parse_spec(data, source="edited")


@pytest.mark.parametrize("family", CASES)
def test_each_classifier_is_transformers(family: str) -> None:
    ref = _hf(family)
    spec = specvit.from_hf(hf_config(ref))
    assert (spec.head.pool, spec.head.classes) == ("last_eos", 3)
    ours, theirs = _run(ref, spec)
    assert ours.shape == theirs.shape == (2, 3)
    assert (ours - theirs).abs().max().item() <= ATOL
    # the controls: the first eos pooled, and the decoder's own start (a start id where mBART wraps)
    first, _ = _run(ref, _edited(ref, **{"head.pool": "eos"}))
    assert (first - theirs).abs().max().item() > 10 * ATOL
    start = 2 if family == "mbart" else 5
    moved, _ = _run(ref, _edited(ref, **{"decoder.input.shifted_source": start}))
    assert (moved - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize(
    ("family", "change"),
    [(f, c) for f, cs in SWITCHES.items() for c in cs],
    ids=lambda v: "-".join(f"{k}={w}" for k, w in v.items()) if isinstance(v, dict) else v,
)
def test_each_field_the_classifier_reads_moves_the_output_as_in_transformers(
    family: str, change: dict[str, Any]
) -> None:
    ref = _hf(family, **change)
    ours, theirs = _run(ref)
    assert (ours - theirs).abs().max().item() <= ATOL
    _, before = _run(_hf(family))
    assert before.shape != theirs.shape or (before - theirs).abs().max().item() > 10 * ATOL


def test_classifier_dropout_reaches_the_head() -> None:
    """Training only: specvit drops out before out_proj (HF before dense too), so it is read, not switched."""
    for family in CASES:
        spec = specvit.from_hf(hf_config(_hf(family, classifier_dropout=0.25)))
        assert spec.head.dropout == 0.25


def test_decoder_reads_the_source_shifted_as_transformers_shifts_it() -> None:
    from transformers.models.bart.modeling_bart import shift_tokens_right as bart_shift
    from transformers.models.mbart.modeling_mbart import shift_tokens_right as mbart_shift

    src, _ = _ids(_hf("bart").config)
    assert torch.equal(shift_right(src, 2), bart_shift(src, 1, 2))
    assert torch.equal(shift_right(src, None, 1), mbart_shift(src, 1))
    assert not torch.equal(shift_right(src, 2), mbart_shift(src, 1))  # the control: the two differ
    x = torch.randn(2, S, 4)
    assert torch.equal(eos_pool(x, src, 2, last=True), x[[0, 1], [11, 8]])
    assert torch.equal(eos_pool(x, src, 2), x[[0, 1], [4, 2]])
    top = torch.tensor([[5, 9, 3, 9, 1], [9, 2, 2, 2, 2]])  # eos_id None: the highest id (CLIP's rule)
    y = torch.randn(2, 5, 4)
    assert torch.equal(eos_pool(y, top, None, last=True), y[[0, 1], [3, 0]])
    assert torch.equal(eos_pool(y, top, None), y[[0, 1], [1, 0]])


@pytest.mark.parametrize("family", CASES)
def test_a_classifier_goes_back_to_transformers(family: str, tmp_path: Path) -> None:
    """HF -> specvit -> HF: AutoModelForSequenceClassification loads specvit's directory as the original class,
    with its logits; a weight changed in specvit comes back changed (the control)."""
    import transformers

    ref = _hf(family)
    ours = converted(ref, specvit.from_hf(hf_config(ref)))
    src, mask = _ids(ref.config)

    def load(directory: Path) -> torch.Tensor:
        back = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
        assert type(back) is type(ref)
        with torch.no_grad():
            return back(input_ids=src, attention_mask=mask).logits

    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=mask).logits
    assert (load(specvit.to_hf(ours, tmp_path / "back")) - want).abs().max().item() <= 1e-5
    with torch.no_grad():
        ours.head.ops[1].weight[0].add_(0.5)  # the dense layer, after the dropout
    assert (load(specvit.to_hf(ours, tmp_path / "changed")) - want).abs().max().item() > 10 * ATOL


def test_the_model_takes_the_source_alone() -> None:
    """``model(src)``, HF's keywords too; no target, so no generate; ejected, the same logits."""
    from specvit.codegen.eject import eject_source

    ref = _hf("bart")
    model = converted(ref, specvit.from_hf(hf_config(ref)))
    assert list(inspect.signature(model.forward).parameters)[:2] == ["src", "src_key_padding_mask"]
    assert "tgt" not in inspect.signature(model.forward).parameters
    src, mask = _ids(ref.config)
    with torch.no_grad():
        want = model(src, src_key_padding_mask=mask == 0)
        assert torch.equal(model(input_ids=src, src_key_padding_mask=mask == 0), want)
    with pytest.raises(TypeError, match=r"reads its source shifted right .*call model\(src\)"):
        model.generate(src, 3, bos_id=2)
    source = eject_source(model.graph)
    assert "def generate" not in source and "shift_right(src, 2)" in source
    space: dict[str, Any] = {}
    exec(compile(source, "ejected.py", "exec"), space)
    ejected = space["Model"]().eval()
    ejected.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(ejected(src, mask == 0), want)


def test_the_exported_model_takes_the_source_alone() -> None:
    """torch.export of ``model(src)``: the source's length stays dynamic (the shift cuts after joining)."""
    ref = _hf("bart")
    model = converted(ref, specvit.from_hf(hf_config(ref)))
    src, _ = _ids(ref.config)
    exported = specvit.export_program(model).module()
    with torch.no_grad():
        for ids in (src, src[:, :9], src[:, :2]):
            assert (exported(ids) - model(ids)).abs().max().item() <= 1e-5


def test_the_graph_is_what_runs() -> None:
    """The shift and the pool are nodes: the traced model is the graph, shapes on the meta device are the
    declared ones, and the source's length is bounded by both position tables."""
    from specvit.codegen.check import differences, executed_graph, meta_shapes
    from specvit.diagram.text import format_table
    from specvit.inputs import sequence_limits

    spec = specvit.from_hf(hf_config(_hf("bart")))
    graph = specvit.build_graph(spec, src_len=S)
    assert graph["decoder.shifted"]["shape"] == ("B", "S_src") and "decoder.input" not in graph.nx
    assert [u for u, _ in graph.nx.in_edges("decoder.shifted")] == ["encoder.input"]
    ids = [u for u, _, port in graph.nx.in_edges("head.pool", data="port") if port == "ids"]
    assert ids == ["encoder.input"]  # the source's ids, not the shifted ones
    model = specvit.build_model(graph, device="meta")
    assert differences(graph, executed_graph(model)) == []
    shapes = meta_shapes(model, (torch.zeros(2, S, dtype=torch.long, device="meta"),))
    assert shapes["decoder.shifted"] == (2, S) and shapes["head.pool"] == (2, 24)
    assert sequence_limits(graph)["S_src"] == 32
    ref = _hf("bart")
    shorter = _edited(ref, **{"decoder.position.max_len": 20})  # the source is the decoder's length too
    assert sequence_limits(shorter)["S_src"] == 20
    assert sequence_limits(_edited(ref, **{"decoder.position.max_len": 20, "decoder.input.shifted_source": None,
                                           "head": {"kind": "lm", "tied": True}}))["S_src"] == 32  # fmt: skip
    table = format_table(graph)
    assert any(row.split()[:3] == ["decoder.shifted", "shift_right", "(B,"] for row in table.splitlines())
    dot = specvit.to_dot(graph)  # drawn: the source into the shift, and the pool's rule
    assert '"encoder.input" -> "decoder.shifted"' in dot and "the last end-of-text token (id 2)" in dot


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("t5", {"decoder_start_token_id": None}, "config.decoder_start_token_id: t5 config has "
         "decoder_start_token_id=None: t5's sequence classifier puts decoder_start_token_id before the source"),
        ("bart", {"pad_token_id": None}, "config.pad_token_id: bart config has pad_token_id=None: bart's sequence "
         "classifier shifts the source right, which HF does only with a pad_token_id"),
        ("bart", {"eos_token_id": None}, "config.eos_token_id: bart config has eos_token_id=None: bart's sequence "
         "classifier pools the decoder's token at the last eos_token_id"),
        ("mbart", {"pad_token_id": None}, "config.pad_token_id: mbart config has pad_token_id=None: mBART's "
         "sequence classifier puts the source's last token that is not pad_token_id first"),
    ],
    ids=["t5_no_start", "bart_no_pad", "no_eos", "mbart_no_pad"],
)  # fmt: skip
def test_token_ids_the_classifier_needs_are_refused_where_null(
    family: str, change: dict[str, Any], message: str
) -> None:
    check_refused(hf_config(_hf(family)), change, message)


@pytest.mark.parametrize("family", ["pegasus", "m2m_100", "marian"])
def test_families_without_the_class_refuse_it(family: str) -> None:
    import transformers

    prefix = {"pegasus": "Pegasus", "m2m_100": "M2M100", "marian": "Marian"}[family]
    config = getattr(transformers, prefix + "Config")(**{k: v for k, v in BART.items() if k != "num_labels"})
    data = config.to_dict()
    specvit.from_hf(data)  # the control: the family reads
    with pytest.raises(
        SpecError, match=rf"architectures=\['{prefix}ForSequenceClassification'\]: specvit reads"
    ):
        specvit.from_hf(data | {"architectures": [prefix + "ForSequenceClassification"]})


BAD = [
    ({"encoder.input.shifted_source": 2}, "encoder.input.shifted_source",
     "shifted_source makes a decoder's ids of its encoder's"),
    ({"decoder.input.shifted_source": 97}, "decoder.input.shifted_source",
     "start id 97 is outside the vocabulary of 97"),
    ({"decoder.input.shifted_source": "last", "decoder.input.padding_idx": None}, "decoder.input.shifted_source",
     "shifted_source last puts the last token that is not padding first, and there is no padding_idx"),
    ({"decoder.input.vocab": 50, "shared_embeddings": False}, "decoder.input.shifted_source",
     "the encoder's ids (vocab 97) index the decoder's table of 50 rows"),
    ({"decoder.input.shifted_source": -1}, "decoder.input.shifted_source", ""),  # no id is negative
    ({"decoder.input.shifted_source": True}, "decoder.input.shifted_source", ""),  # nor a bool
]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "path", "message"), BAD, ids=["encoder", "start", "last", "vocab", "negative", "bool"]
)
def test_a_shift_no_model_computes_is_refused(changes: dict[str, Any], path: str, message: str) -> None:
    ref = _hf("bart")
    _edited(ref)  # the control: the spec as imported is valid
    with pytest.raises(SpecError) as err:
        _edited(ref, **changes)
    assert any(p.path == path and message in p.message for p in err.value.problems), err.value


def test_a_shift_of_an_encoder_reading_no_ids_and_an_eos_pool_of_no_ids_are_refused() -> None:
    base = {"specvit": 1, "name": "x", "model": "encoder_decoder",
            "encoder": {"input": {"kind": "features", "dim": 8}, "width": 16, "depth": 1, "block": {"heads": 2},
                        "position": "none"},
            "decoder": {"input": {"kind": "tokens", "vocab": 11}, "width": 16, "depth": 1, "position": "rope",
                        "block": {"heads": 2, "layers": ["masked_self_attention", "cross_attention", "mlp"]}},
            "head": {"kind": "lm"}}  # fmt: skip
    parse_spec(base, source="control")
    base["decoder"]["input"]["shifted_source"] = 0
    with pytest.raises(
        SpecError, match="shifted_source shifts the encoder's token ids, and the encoder reads features"
    ):
        parse_spec(base, source="features")
    image = {"specvit": 1, "name": "y", "model": "encoder", "head": {"kind": "classifier", "classes": 2,
             "pool": "last_eos"}, "encoder": {"input": {"kind": "image", "size": 8, "patch": 4}, "width": 16,
             "depth": 1, "block": {"heads": 2}, "position": "learned"}}  # fmt: skip
    with pytest.raises(SpecError, match="pool last_eos picks the end-of-text token of a token input"):
        parse_spec(image, source="image")
    parse_spec(image | {"head": {"kind": "classifier", "classes": 2, "pool": "mean"}}, source="control")


@pytest.mark.parametrize("family", CASES)
def test_a_left_padded_source_is_transformers(family: str) -> None:
    """Padding in front: the encoder masks it, the decoder reads it shifted (HF's decoder masks none), and
    mBART's start is the token at (ids != pad).sum() - 1, as HF finds it, whatever it is."""
    ref = _hf(family, seed=3)
    model = converted(ref, specvit.from_hf(hf_config(ref)))
    src, _ = _ids(ref.config)
    pad = 1 if family in ("bart", "mbart") else 0
    src[1] = torch.cat((torch.full((4,), pad), src[1, :9]))  # the second row's 9 tokens after 4 pads
    mask = (src != pad).long()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask).logits
        ours = model(src, src_key_padding_mask=mask == 0)
        unmasked = ref(input_ids=src).logits  # the control: the padding mask changes what HF computes
    assert (ours - theirs).abs().max().item() <= ATOL
    assert (unmasked - theirs).abs().max().item() > 10 * ATOL


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_the_head_drops_out_where_transformers_does(family: str) -> None:
    """HF's classification head drops out before ``dense`` and before ``out_proj``, both at
    ``classifier_dropout``: the spec's head holds both, in that order, and ``to_hf`` writes the rate back."""
    ref = _hf(family, classifier_dropout=0.3)
    model = converted(ref, specvit.from_hf(hf_config(ref)))
    ops = list(model.head.ops)  # type: ignore[union-attr]
    assert isinstance(ops[0], nn.Dropout) and ops[0].p == 0.3 and isinstance(ops[1], nn.Linear)
    assert model.spec.head.dropout == 0.3
    head = type(ref.classification_head)
    dense, out_proj = (inspect.getsource(head.forward).index(k) for k in ("self.dense(", "self.out_proj("))
    assert inspect.getsource(head.forward)[:dense].count("self.dropout(") == 1  # the reference's order
    assert inspect.getsource(head.forward)[dense:out_proj].count("self.dropout(") == 1
    assert spec_dict(ref)["head"]["ops"][0] == {"kind": "dropout", "p": 0.3}
