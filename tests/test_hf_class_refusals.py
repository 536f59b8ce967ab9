"""Models from_hf reads by their class, refused where the class computes what no spec of it does: a base model
built with a pooler its family does not read (passed as a model), ViTMAEModel (random masking in every call), and a T5 config that is
not an encoder-decoder's (transformers' decoder then computes another model). Each refusal is a SpecError
naming the field and its value; the control of each is the same model read."""

from __future__ import annotations

import pytest
import torch
from reference import converted, hf_model

import specvit
from specvit.errors import SpecError

BERT = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=40)
VIT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=40, image_size=32,
           patch_size=8)  # fmt: skip


def test_a_pooler_its_family_does_not_read_is_refused() -> None:
    """from_hf(model) of a base model holding a pooler its family reads no head for names the class and the
    pooler's weights (the converter could place none of them). Every family whose HF base class builds one
    reads it (tests/test_hf_poolers.py); an ELECTRA model given a pooler stands for a family that would not.
    The control: the same model without it is read, its last hidden state HF's."""
    import transformers

    hf_config = transformers.ElectraConfig(**BERT, embedding_size=32)
    bare = hf_model("ElectraModel", hf_config).eval()
    model = converted(bare, specvit.from_hf(bare))  # the control
    x = torch.randint(3, 50, (2, 6))
    with torch.no_grad():
        assert (model(x) - bare(x).last_hidden_state).abs().max().item() <= 1e-5
    bare.pooler = torch.nn.Linear(32, 32)
    with pytest.raises(SpecError) as info:
        specvit.from_hf(bare)
    message = str(info.value)
    assert (
        "config.architectures: electra config has architectures=['ElectraModel']: this ElectraModel builds a "
        "pooler (pooler.weight, pooler.bias) whose pooler_output a spec without a head does not compute"
    ) in message
    assert "build it with ElectraModel(config, add_pooling_layer=False)" in message


def test_vit_mae_reads_the_pretraining_class_only() -> None:
    import transformers

    config = transformers.ViTMAEConfig(**VIT, decoder_hidden_size=16, decoder_num_hidden_layers=1)
    assert specvit.from_hf(hf_model("ViTMAEForPreTraining", config)).model == "encoder_decoder"  # the control
    with pytest.raises(SpecError, match=r"config\.architectures: vit_mae config has architectures=\['ViTMAEModel'\]: "
                       r"specvit reads ViTMAEForPreTraining \(ViTMAEModel masks a random share"):  # fmt: skip
        specvit.from_hf(hf_model("ViTMAEModel", config))


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
def test_a_t5_config_that_is_no_encoder_decoder_is_refused(model_type: str) -> None:
    """transformers' T5 reads is_encoder_decoder to build its decoder's caches, and without it the logits
    change (2.0 seen): refused, where every other family's forward ignores it."""
    config = {
        "model_type": model_type,
        "d_model": 32,
        "num_layers": 1,
        "num_heads": 2,
        "d_kv": 16,
        "d_ff": 40,
    }
    specvit.from_hf(config | {"is_encoder_decoder": True})  # the control
    with pytest.raises(
        SpecError, match=f"config.is_encoder_decoder: {model_type} config has is_encoder_decoder=False"
    ):
        specvit.from_hf(config | {"is_encoder_decoder": False})
