"""Hostile input, third round (#30): calls with the wrong things, and --set paths longer than a spec nests.

Each class is tested as a class: every input dtype a model cannot take (by what the input is), every device
other than the weights', every argument of every API entry point given each wrong type; the message names
the argument and says what to pass. The control: the right call succeeds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specvit
from specvit.cli import main
from specvit.inputs import InputError

ROOT = Path(__file__).resolve().parents[1]
TOKENS = {
    "input": {"kind": "tokens", "vocab": 12},
    "position": {"kind": "learned", "max_len": 16},
    "width": 32,
}
ENCODER = {
    "specvit": 1,
    "name": "enc",
    "model": "encoder",
    "encoder": {**TOKENS, "depth": 1, "block": {"heads": 2}},
    "head": {"kind": "classifier", "classes": 3, "pool": "mean"},
}
DECODER = {
    "specvit": 1,
    "name": "dec",
    "model": "decoder",
    "decoder": {**TOKENS, "depth": 1, "block": {"heads": 2, "layers": ["masked_self_attention", "mlp"]}},
    "head": {"kind": "lm"},
}


@pytest.fixture(scope="module")
def models() -> dict[str, specvit.SpecModel]:
    torch.manual_seed(0)
    return {
        "enc": specvit.build_model(ENCODER).eval(),
        "dec": specvit.build_model(DECODER).eval(),
        "s2s": specvit.build_model("tiny_seq2seq").eval(),
        "vit": specvit.build_model("mnist_vit").eval(),
    }


IDS = torch.tensor([[3, 4, 5, 6, 0], [7, 8, 9, 1, 2]])
WRONG_ID_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.bool, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", WRONG_ID_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["enc", "dec"])
def test_token_ids_of_a_dtype_an_embedding_cannot_take_say_long(
    models: dict[str, specvit.SpecModel], name: str, dtype: torch.dtype
) -> None:
    model = models[name]
    arg = "x" if name == "enc" else "tokens"
    with pytest.raises(
        InputError, match=rf"^{arg}: expected integer token ids, got {dtype}; pass {arg}.long\(\)$"
    ):
        model(IDS.to(dtype))
    assert torch.equal(
        model(IDS.to(dtype).long() if dtype != torch.bool else IDS), model(IDS.int())
    )  # control


MASKS = [
    torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]),
    torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.uint8),
    torch.tensor([[0.0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]),
    torch.tensor([[0.0, 0, 0, float("-inf"), float("-inf")], [0, 0, 0, 0, 0]]),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: str(m.dtype))
@pytest.mark.parametrize(
    ("name", "arg"),
    [("enc", "key_padding_mask"), ("dec", "key_padding_mask"), ("s2s", "src_key_padding_mask")],
)
def test_a_padding_mask_that_is_not_bool_says_what_to_pass(
    models: dict[str, specvit.SpecModel], name: str, arg: str, mask: torch.Tensor
) -> None:
    model = models[name]
    inputs = (IDS, IDS) if name == "s2s" else (IDS,)
    with pytest.raises(InputError) as info:
        model(*inputs, **{arg: mask})
    assert str(info.value) == (
        f"{arg}: expected a bool mask (True marks padding), got {mask.dtype}; pass {arg}.bool() for a 1/0 mask of "
        f"padding, or {arg} == 0 for HF's attention_mask (1 marks tokens)"
    )
    padded = model(*inputs, **{arg: mask != 0})  # the control: the bool mask it says to pass
    assert not torch.equal(padded, model(*inputs))


@pytest.mark.parametrize(
    ("name", "where"), [("enc", "ids"), ("dec", "ids"), ("vit", "ids"), ("enc", "mask"), ("dec", "mask")]
)
def test_an_input_on_another_device_than_the_weights_is_refused(
    models: dict[str, specvit.SpecModel], name: str, where: str
) -> None:
    model = models[name]
    x = torch.randn(2, 1, 28, 28) if name == "vit" else IDS
    arg = {"enc": "x", "dec": "tokens", "vit": "x"}[name]
    if where == "mask":
        with pytest.raises(
            InputError, match=r"^key_padding_mask: the tensor is on meta and the model's weights"
        ):
            model(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta"))
        return
    with pytest.raises(InputError) as info:  # meta ids returned garbage, different on each call
        model(x.to("meta"))
    assert str(info.value) == (
        f"{arg}: the tensor is on meta and the model's weights are on cpu; pass {arg}.to('cpu') "
        "(a tensor on meta holds no values)"
    )
    assert model(x).device.type == "cpu"  # control


@pytest.mark.parametrize("name", ["enc", "dec", "vit", "s2s"])
def test_a_required_input_given_as_none_is_named(models: dict[str, specvit.SpecModel], name: str) -> None:
    model = models[name]
    x = torch.randn(2, 1, 28, 28) if name == "vit" else IDS
    want = {
        "enc": "x: expected a tensor of token ids (batch, seq_len), got None",
        "dec": "tokens: expected a tensor of token ids (batch, seq_len), got None",
        "vit": "x: expected a tensor of image 28x28 (batch, 1, 28, 28), got None",
        "s2s": "tgt: expected a tensor of token ids (batch, tgt_len), got None",
    }[name]
    with pytest.raises(InputError) as info:
        model(x, None) if name == "s2s" else model(None)
    assert str(info.value) == want


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offset": "1"}, "offset: expected an int (positions already decoded), got str"),
        ({"offset": -1}, "offset: expected an int >= 0 (positions already decoded), got -1"),
        ({"cache": 5}, "cache: expected a specvit.nn.attention.KVCache or None, got int"),
    ],
)
def test_decoding_arguments_are_typed(
    models: dict[str, specvit.SpecModel], kwargs: dict, message: str
) -> None:
    with pytest.raises(InputError) as info:
        models["dec"](IDS, **kwargs)
    assert str(info.value) == message


GENERATE = [
    ({"max_new_tokens": "5"}, TypeError, "max_new_tokens must be an integer, got str '5'"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens must be an integer, got float 2.0"),
    (
        {"pad_id": 1 << 70, "eos_id": 1},
        ValueError,
        "pad_id must be <= 11, got 1180591620717411303424 (a token id of the model's vocabulary of 12)",
    ),
    ({"eos_id": 12}, ValueError, "eos_id must be <= 11, got 12 (a token id of the model's vocabulary of 12)"),
    (
        {"pad_id": -1, "eos_id": 1},
        ValueError,
        "pad_id must be >= 0, got -1 (a token id of the model's vocabulary of 12)",
    ),
    ({"use_cache": "no"}, TypeError, "use_cache must be True or False, got str 'no'"),
    ({"temperature": 1.0, "generator": 5}, TypeError, "generator must be a torch.Generator or None, got int"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), GENERATE, ids=lambda v: str(v)[:30])
@pytest.mark.parametrize("name", ["dec", "s2s"])
def test_generate_names_each_wrong_argument(
    models: dict[str, specvit.SpecModel], name: str, kwargs: dict, error: type, message: str
) -> None:
    model = models[name]
    call = {"max_new_tokens": 3, **kwargs}
    if name == "s2s":
        call["bos_id"] = 1
    with pytest.raises(error) as info:
        model.generate(IDS, **call)
    assert str(info.value) == message
    call.update(max_new_tokens=3, eos_id=1, pad_id=0, use_cache=True, generator=None)  # the control
    assert model.generate(IDS, **call).shape[0] == 2


def test_generate_refuses_a_prompt_on_another_device(models: dict[str, specvit.SpecModel]) -> None:
    with pytest.raises(InputError, match=r"^tokens: the tensor is on meta .* pass tokens.to\('cpu'\)"):
        models["dec"].generate(IDS.to("meta"), 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dtype": torch.int64}, ValueError, "dtype torch.int64 is not a dtype weights compute in"),
        ({"dtype": torch.complex64}, ValueError, "dtype torch.complex64 is not a dtype weights compute in"),
        (
            {"dtype": torch.float8_e4m3fn},
            ValueError,
            "dtype torch.float8_e4m3fn is not a dtype weights compute in",
        ),
        (
            {"dtype": "fp16"},
            TypeError,
            "dtype must be a torch.dtype such as torch.float32, got the string 'fp16'",
        ),
        ({"dtype": 32}, TypeError, "dtype must be a torch.dtype such as torch.float32, got int"),
        ({"device": "gpu"}, ValueError, "device 'gpu' is not a device torch knows"),
        ({"device": 1.5}, TypeError, "device must be a torch.device or a string such as 'cpu', got float"),
        ({"checkpointing": "yes"}, TypeError, "checkpointing must be True or False, got str 'yes'"),
        (
            {"overrides": ["encoder.depth=1"]},
            TypeError,
            "overrides must be a mapping of dotted keys to values",
        ),
    ],
    ids=lambda v: str(v)[:30],
)
def test_build_model_names_each_wrong_argument(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        specvit.build_model("mnist_vit", **kwargs)
    assert str(info.value).startswith(message)
    assert specvit.build_model("mnist_vit", dtype="float64", device="meta").encoder.blocks[0]  # control


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch": 2.5}, TypeError, "batch must be an integer, got float 2.5"),
        ({"batch": True}, TypeError, "batch must be an integer, got True"),
        ({"batch": 0}, ValueError, "batch must be >= 1, got 0"),
        ({"seq_len": 0}, ValueError, "seq_len must be >= 1, got 0 (None for the default)"),
        ({"seq_len": "8"}, TypeError, "seq_len must be an integer, got str '8'"),
        ({"tgt_len": 0}, ValueError, "tgt_len must be >= 1, got 0 (None for the default)"),
    ],
)
def test_build_graph_sizes_are_positive_integers(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        specvit.build_graph("tiny_seq2seq", **kwargs)
    assert str(info.value) == message
    assert specvit.build_graph("tiny_seq2seq", batch=2, seq_len=8).dims["S_src"] == 8  # control


@pytest.mark.parametrize("overrides", [["encoder.depth=1"], "encoder.depth=1", [("encoder.depth", 1)]])
def test_overrides_that_are_not_a_mapping_are_a_type_error(overrides: object) -> None:
    for call in (specvit.load_spec, specvit.build_graph):
        with pytest.raises(TypeError, match=r"^overrides must be a mapping of dotted keys to values"):
            call("mnist_vit", overrides)
    spec = specvit.load_spec("mnist_vit")
    with pytest.raises(TypeError, match=r"^overrides must be a mapping"):
        specvit.parse_spec(spec.to_yaml(), overrides=overrides)
    assert specvit.load_spec("mnist_vit", {"encoder.depth": 1}).encoder.depth == 1  # control


def _bad_states(model: specvit.SpecModel) -> list[tuple[object, type, str]]:
    state = model.state_dict()
    first = next(iter(state))
    return [
        ({k: v for k, v in state.items() if k != first}, ValueError, f"missing {first}"),
        ({**state, "extra.weight": torch.zeros(1)}, ValueError, "unexpected extra.weight [1]"),
        ({**state, first: state[first][:1]}, ValueError, f"{first}: checkpoint has [1,"),
        (
            {**state, first: state[first].to(torch.float8_e4m3fn)},
            ValueError,
            "a dtype the model cannot compute in",
        ),
        (
            {**state, first: state[first].tolist()},
            TypeError,
            f"state_dict['{first}'] must be a tensor, got list",
        ),
        ([1, 2], TypeError, "state_dict must be a mapping of names to tensors (a state dict), got list"),
    ]


def test_save_pretrained_refuses_what_would_not_load(
    models: dict[str, specvit.SpecModel], tmp_path: Path
) -> None:
    model = models["vit"]
    for i, (state, error, message) in enumerate(_bad_states(model)):
        with pytest.raises(error) as info:
            model.save_pretrained(tmp_path / str(i), state_dict=state)  # type: ignore[arg-type]
        assert message in str(info.value)
        assert not (tmp_path / str(i)).exists()  # nothing written
    with pytest.raises(TypeError, match=r"^save_pretrained saves a model compiled by specvit .* got Linear"):
        specvit.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
    with pytest.raises(TypeError, match=r"^directory must be a path \(a str or pathlib.Path\), got int"):
        model.save_pretrained(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^overwrite must be True or False, got str 'no'"):
        model.save_pretrained(tmp_path / "o", overwrite="no")  # type: ignore[arg-type]
    model.save_pretrained(tmp_path / "ok", state_dict=dict(model.state_dict()))  # control: loads whole
    loaded = specvit.load_pretrained(tmp_path / "ok")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_convert_state_dict_names_wrong_arguments() -> None:
    spec = specvit.load_spec("vit_tiny_patch16_224")
    with pytest.raises(TypeError, match=r"^state_dict\['a'\] must be a tensor, got int"):
        specvit.convert_state_dict({"a": 1}, "timm", spec)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"^spec must be a Spec, got str; pass specvit.load_spec"):
        specvit.convert_state_dict({}, "timm", "vit_tiny_patch16_224")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^source must be one of \['hf', 'timm', 'torch'\], got 5"):
        specvit.convert_state_dict({}, 5, spec)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing"):  # control: tensors reach the converter, which names keys
        specvit.convert_state_dict({"cls_token": torch.zeros(1, 1, 192)}, "timm", spec)


@pytest.mark.parametrize("levels", [65, 60_000])
def test_a_set_path_deeper_than_a_spec_nests_is_refused_at_once(
    levels: int, capsys: pytest.CaptureFixture[str]
) -> None:
    item = "a." * (levels - 1) + "b=1"
    assert main(["validate", str(ROOT / "specs" / "mnist_vit.yaml"), "--set", item]) == 2
    err = capsys.readouterr().err
    assert err.startswith("<--set a.a.a.") and len(err.splitlines()) == 1 and len(err) < 500
    assert f"has {levels:,} keys, more than the 64 levels a spec may nest" in err
    assert (
        main(["validate", str(ROOT / "specs" / "mnist_vit.yaml"), "--set", "encoder.depth=1"]) == 0
    )  # control


def test_the_collapsed_view_folds_a_deep_stack_of_many_sublayers_into_one_run() -> None:
    layers = ["masked_self_attention", "mlp"] * 8  # 16 sublayers: the collapsed view took minutes at 1,024
    spec = {
        **DECODER,
        "decoder": {**DECODER["decoder"], "depth": 64, "block": {"heads": 2, "layers": layers}},
    }
    graph = specvit.build_graph(spec)
    rows = graph.summary()
    blocks = [r for r in rows if ".blocks." in r.path]
    assert blocks and {r.count for r in blocks} == {64}
    assert all(r.path.startswith("decoder.blocks.0-63") for r in blocks)
    assert len(graph.summary(expand=True)) == len(rows) + 63 * len(blocks)  # control: every block expanded
    first = graph.signature("decoder.blocks.0")
    node = next(n for n in graph if graph[n]["block"] == "decoder.blocks.0")
    graph.nx.add_node("decoder.blocks.0.extra", **graph[node])  # the index of blocks' nodes follows
    assert graph.signature("decoder.blocks.0") != first
