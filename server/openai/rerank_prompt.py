"""Qwen3-Reranker's prompt: a judge's system turn, the instruction, query and document in the
user turn, and an empty thinking block opening the assistant's answer, whose first token is
"yes" or "no". The relevance score is P("yes") over the pair: softmax over the logits of
"yes" and "no" at the prompt's last position (the model card's format)."""

from __future__ import annotations

import math

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    return (f"{_PREFIX}<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{_SUFFIX}")


def yes_no_token_ids(tokenizer) -> tuple[int, int]:
    """The ids of "yes" and "no" (ValueError if the vocabulary lacks either)."""
    ids = tuple(tokenizer.convert_tokens_to_ids(word) for word in ("yes", "no"))
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError("the reranker's vocabulary has no 'yes' or 'no' token")
    return ids


def relevance(yes_no_logits: list[float]) -> float:
    """P("yes") against "no": the softmax over the pair."""
    yes, no = yes_no_logits
    return 1.0 / (1.0 + math.exp(no - yes))
