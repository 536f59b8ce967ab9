"""Calling a compiled model as other libraries' models are called: channels-last images, inputs of another
float dtype, one unbatched sequence, and HF's keyword names. Each message is quoted whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import specvit
from specvit.inputs import InputError
from specvit.keywords import FOREIGN_ARGUMENTS

TINY_GPT = {"decoder.depth": 1, "decoder.width": 32, "decoder.block.heads": 2}


@pytest.fixture(scope="module")
def vit() -> Any:
    return specvit.build_model("mnist_vit").eval()  # (B, 1, 28, 28)


@pytest.fixture(scope="module")
def gpt() -> Any:
    return specvit.build_model("gpt2_small", overrides=TINY_GPT).eval()


@pytest.fixture(scope="module")
def seq2seq() -> Any:
    return specvit.build_model("tiny_seq2seq").eval()


def _message(error: type[Exception], call: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(error) as info, torch.no_grad():
        call(*args, **kwargs)
    return str(info.value)


def test_channels_last_images_say_how_to_permute() -> None:
    model = specvit.build_model("mnist_vit", overrides={"encoder.input.channels": 3}).eval()
    assert _message(InputError, model, torch.randn(2, 28, 28, 3)) == (
        "x: expected (batch, 3, 28, 28) (image 28x28), got (2, 28, 28, 3): the channels come last; "
        "pass x.permute(0, 3, 1, 2)"
    )
    assert _message(InputError, model, torch.randn(28, 28, 3)) == (
        "x: expected (batch, 3, 28, 28) (image 28x28), got (28, 28, 3): one example with the channels last; "
        "pass x.permute(2, 0, 1).unsqueeze(0)"
    )
    with torch.no_grad():  # the fix as said
        assert model(torch.randn(2, 28, 28, 3).permute(0, 3, 1, 2)).shape == (2, 10)
        assert model(torch.randn(28, 28, 3).permute(2, 0, 1).unsqueeze(0)).shape == (1, 10)


@pytest.mark.parametrize(
    ("dtype", "fix"),
    [
        (torch.float64, "pass x.float(), or convert the model with model.double()"),
        (torch.float16, "pass x.float(), or convert the model with model.half()"),
        (torch.bfloat16, "pass x.float(), or convert the model with model.bfloat16()"),
    ],
    ids=["float64", "float16", "bfloat16"],
)
def test_inputs_of_another_float_dtype_say_how_to_cast(vit: Any, dtype: torch.dtype, fix: str) -> None:
    x = torch.randn(2, 1, 28, 28, dtype=dtype)
    assert _message(InputError, vit, x) == (
        f"x: got {dtype} values, and the model's weights are torch.float32; {fix}"
    )


def test_a_model_in_float64_asks_for_float64_and_autocast_is_left_alone(vit: Any) -> None:
    double = specvit.build_model("mnist_vit").double().eval()
    assert _message(InputError, double, torch.randn(2, 1, 28, 28)) == (
        "x: got torch.float32 values, and the model's weights are torch.float64; pass x.double(), or convert "
        "the model with model.float()"
    )
    with torch.no_grad():
        assert double(torch.randn(2, 1, 28, 28, dtype=torch.float64)).dtype == torch.float64
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: bf16 inputs are its to take
            assert vit(torch.randn(2, 1, 28, 28, dtype=torch.bfloat16)).shape == (2, 10)


def test_one_sequence_without_a_batch_says_unsqueeze(gpt: Any) -> None:
    ids = torch.randint(0, 50257, (8,))
    assert _message(InputError, gpt, ids) == (
        "tokens: expected (batch, seq_len) (token ids), got (8): the batch dimension is missing; "
        "pass tokens.unsqueeze(0) for a single example"
    )
    assert _message(ValueError, gpt.generate, ids, 2) == (
        "the prompt must be a 2-D (batch, length) tensor of integer token ids, got a 1-D int64 tensor of "
        "shape [8]; pass tokens.unsqueeze(0) for one prompt"
    )


def test_hf_keyword_names_of_the_same_meaning_are_accepted(gpt: Any, vit: Any, seq2seq: Any) -> None:
    ids = torch.randint(0, 50257, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(gpt(input_ids=ids), gpt(ids), rtol=0, atol=0)
        x = torch.randn(2, 1, 28, 28)
        torch.testing.assert_close(vit(pixel_values=x), vit(x), rtol=0, atol=0)
        src, tgt = torch.randint(0, 12, (2, 5)), torch.randint(0, 12, (2, 4))
        torch.testing.assert_close(
            seq2seq(input_ids=src, decoder_input_ids=tgt), seq2seq(src, tgt), rtol=0, atol=0
        )


def test_hf_keyword_names_of_another_meaning_say_what_to_pass(gpt: Any, vit: Any) -> None:
    ids = torch.randint(0, 50257, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    assert _message(TypeError, gpt, ids, attention_mask=mask) == (
        "attention_mask: HF's attention mask is key_padding_mask here; True marks padding in key_padding_mask, "
        "the inverse of HF's attention_mask: pass key_padding_mask=attention_mask == 0"
    )
    with torch.no_grad():  # the fix as said
        assert gpt(ids, key_padding_mask=mask == 0).shape == (2, 8, 50257)
    assert _message(TypeError, gpt, ids, labels=ids) == (
        "labels: HF's training labels; the model returns logits, not a loss: compute the loss from them "
        "(torch.nn.functional.cross_entropy)"
    )
    assert _message(TypeError, vit, input_ids=ids) == (
        "input_ids: HF's token ids, which mnist_vit does not take; it takes x (image 28x28)"
    )
    assert _message(TypeError, gpt, pixel_values=torch.randn(2, 3, 8, 8)) == (
        "pixel_values: HF's images, which gpt2_small does not take; it takes tokens (token ids), "
        "key_padding_mask (padding mask), cache, offset"
    )


def test_unknown_keywords_name_the_arguments_the_model_takes(vit: Any, gpt: Any) -> None:
    assert _message(TypeError, vit, torch.randn(2, 1, 28, 28), return_dict=True) == (
        "mnist_vit takes no argument 'return_dict'; it takes x (image 28x28)"
    )
    ids = torch.randint(0, 50257, (2, 8))
    assert _message(TypeError, gpt, tokens=ids, input_ids=ids) == (
        "gpt2_small got tokens twice: as tokens= and as input_ids="
    )


def test_the_table_holds_no_argument_a_model_takes() -> None:
    """A model's own argument is never renamed: every name in the table is one no compiled model takes,
    but PyTorch's src_key_padding_mask, an encoder-decoder's own name for its encoder's padding mask."""
    taken: set[str] = set()
    for name in ("mnist_vit", "bert_base", "gpt2_small", "tiny_seq2seq", "detr_resnet50"):
        graph = specvit.build_graph(name)
        taken |= {graph[n]["p"].arg for n in graph.placeholders()}
    assert set(FOREIGN_ARGUMENTS) & taken == {"src_key_padding_mask"}
