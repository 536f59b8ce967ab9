"""Models from_hf reads by their class, refused where the class computes what no spec of it does: a base model
built with its pooler (passed as a model), ViTMAEModel (random masking in every call), and a T5 config that is
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


@pytest.mark.parametrize(
    ("cls", "config", "sizes", "pooler"),
    [("BertModel", "BertConfig", BERT, "pooler.dense.weight, pooler.dense.bias"),
     ("ViTModel", "ViTConfig", VIT, "pooler.dense.weight, pooler.dense.bias"),
     ("AlbertModel", "AlbertConfig", BERT, "pooler.weight, pooler.bias")],
)  # fmt: skip
def test_a_base_model_built_with_its_pooler_is_refused(
    cls: str, config: str, sizes: dict, pooler: str
) -> None:
    """from_hf(model) of a base model holding a pooler names the class and the pooler's weights (the converter
    could place none of them); built without it, the same class is read and its last hidden state is HF's."""
    import transformers

    hf_config = getattr(transformers, config)(**sizes)
    with pytest.raises(SpecError) as info:
        specvit.from_hf(hf_model(cls, hf_config))
    message = str(info.value)
    assert (
        f"config.architectures: {hf_config.model_type} config has architectures=['{cls}']: this {cls} builds"
        in message
    )
    assert f"a pooler ({pooler}) whose pooler_output a spec without a head does not compute" in message
    assert f"build it with {cls}(config, add_pooling_layer=False)" in message
    bare = hf_model(cls, hf_config, add_pooling_layer=False).eval()  # the control
    model = converted(bare, specvit.from_hf(bare))
    x = torch.randint(3, 50, (2, 6)) if cls != "ViTModel" else torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = bare(x).last_hidden_state
        assert (model(x) - want).abs().max().item() <= 1e-5


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
