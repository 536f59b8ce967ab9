"""More families of the BERT-like encoder layout (:data:`~specvit.interop.hf_bert.BERT`): Splinter.

Splinter's encoder is BERT's without a pooler. Its question-answering and pretraining classes put a
question-aware span selection head (QASS) on it: the hidden state of each ``question_token_id`` token,
transformed, scores every token bilinearly as a start and as an end. That head gathers tokens by their ids and
has no spec op, so those classes are refused by name; ``SplinterModel`` is read.
"""

from __future__ import annotations

from specvit.interop.hf_bert import BERT, encoder_family
from specvit.interop.table import register

__all__: list[str] = []

SPLINTER = register(
    encoder_family(
        BERT,
        "Splinter",
        ("splinter",),
        "splinter.",
        drop=(
            # fields BERT's config has and Splinter's does not (it reads none of them)
            "is_decoder",
            "add_cross_attention",
            "position_embedding_type",
            "ForTokenClassification",
            "ForQuestionAnswering",  # QASS, not BERT's qa_outputs
            "ForMaskedLM",
            "ForSequenceClassification",
        ),
        inert=("question_token_id",),  # read by the QASS classes only, which are refused
        pooled=None,  # SplinterModel has no pooler
    )
)
