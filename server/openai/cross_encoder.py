"""A cross-encoder's (bge-reranker's) pair prompt and score: the query and the document
encoded together as the tokenizer pairs them (`[CLS] query [SEP] document [SEP]` for BERT,
token types 0 then 1), the classifier's one logit read at the first token, through the
sigmoid where the model's sentence-transformers config says (its default for one label)."""

from __future__ import annotations

import math

from metal_engine.segments import with_segments


def pair_prompts(tokenizer, queries: list[str], documents: list[str]) -> list[list[int]]:
    """Each pair's token ids, their token types carried in them (metal_engine.segments)."""
    encoded = tokenizer(queries, documents)
    types = encoded.get("token_type_ids") or [[0] * len(ids) for ids in encoded["input_ids"]]
    return [with_segments(ids, kinds) for ids, kinds in zip(encoded["input_ids"], types,
                                                            strict=True)]


def classifier_score(logits: list[float], sigmoid: bool) -> float:
    (logit,) = logits
    if not sigmoid:
        return logit
    tail = math.exp(-abs(logit))  # never overflows
    return 1.0 / (1.0 + tail) if logit >= 0 else tail / (1.0 + tail)
