"""Which tokenizers speak harmony (GPT-OSS's message format), and harmony's encoding for
them, built offline.

openai-harmony reads its vocabulary from an `o200k_base.tiktoken` file that it downloads
unless `TIKTOKEN_ENCODINGS_BASE` names a folder holding it, and it checks the file's sha256
either way. The model's own tokenizer holds the same vocabulary, so the file is written from
it into a temporary folder for the one load: the server never downloads anything, and a
vocabulary that is not o200k_base's fails the library's hash check instead of mis-encoding.
"""

from __future__ import annotations

import base64
import contextlib
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openai_harmony import HarmonyEncoding, HarmonyEncodingName, HarmonyError
from openai_harmony import load_harmony_encoding as _load_harmony_encoding

# Harmony's control tokens at the ids its encoding gives them: a tokenizer with all of them
# there speaks harmony (GPT-OSS's tokenizers do), and harmony's prompt ids are valid for it.
HARMONY_CONTROLS = {
    "<|return|>": 200002, "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
    "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012,
}  # fmt: skip
O200K_BASE_SIZE = 199998  # byte-level tokens (ranks 0..199997); the special tokens follow
VOCAB_FILE = "o200k_base.tiktoken"
_ENCODINGS_BASE_VAR = "TIKTOKEN_ENCODINGS_BASE"

_LOCK = threading.Lock()
_SPEAKS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_ENCODINGS: weakref.WeakKeyDictionary[Any, HarmonyEncoding] = weakref.WeakKeyDictionary()


def speaks_harmony(tokenizer: Any) -> bool:
    """Whether the tokenizer has harmony's control tokens at harmony's ids."""
    with _LOCK:
        known = _SPEAKS.get(tokenizer)
        if known is None:
            added = getattr(tokenizer, "added_tokens_decoder", None) or {}  # test doubles: none
            known = all(
                getattr(added.get(token_id), "content", None) == text
                for text, token_id in HARMONY_CONTROLS.items()
            )
            _SPEAKS[tokenizer] = known
        return known


def harmony_encoding(tokenizer: Any) -> HarmonyEncoding:
    """GPT-OSS's harmony encoding, from the vocabulary of `tokenizer` (loaded once per
    tokenizer). A ValueError says why when the vocabulary is not o200k_base's."""
    with _LOCK:
        encoding = _ENCODINGS.get(tokenizer)
        if encoding is None:
            encoding = _ENCODINGS[tokenizer] = load_offline(o200k_vocab_file(tokenizer))
        return encoding


def load_offline(vocab_file: bytes) -> HarmonyEncoding:
    """Harmony's GPT-OSS encoding over `vocab_file` (the text of `o200k_base.tiktoken`)."""
    with tempfile.TemporaryDirectory(prefix="metal-serve-harmony-") as folder:
        Path(folder, VOCAB_FILE).write_bytes(vocab_file)
        with _environment(_ENCODINGS_BASE_VAR, folder):
            try:
                return _load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
            except HarmonyError as exc:
                raise ValueError(
                    "This tokenizer has harmony's control tokens but openai-harmony refused "
                    f"its vocabulary ({exc}); GPT-OSS models need the o200k_base vocabulary "
                    "their own tokenizer.json ships: check the model directory's tokenizer."
                ) from exc


def o200k_vocab_file(tokenizer: Any) -> bytes:
    """The tiktoken file of the tokenizer's byte-level tokens: `base64(bytes) rank` lines in
    rank order, the format and content of `o200k_base.tiktoken` for a GPT-OSS tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            "A harmony model needs a fast (tokenizer.json) tokenizer to build its encoding; "
            "the model directory has none."
        )
    vocab = backend.get_vocab(with_added_tokens=False)
    by_rank = sorted((rank, token) for token, rank in vocab.items() if rank < O200K_BASE_SIZE)
    if [rank for rank, _ in by_rank] != list(range(O200K_BASE_SIZE)):
        raise ValueError(
            f"A harmony tokenizer needs byte-level tokens at ids 0..{O200K_BASE_SIZE - 1}; "
            f"this one has {len(by_rank)} of them: it is not GPT-OSS's tokenizer."
        )
    to_byte = _byte_level_decoder()
    try:
        lines = [
            base64.b64encode(bytes(to_byte[char] for char in token)) + b" %d\n" % rank
            for rank, token in by_rank
        ]
    except KeyError:
        raise ValueError(
            "A harmony tokenizer needs byte-level BPE tokens; this one has others: it is not "
            "GPT-OSS's tokenizer."
        ) from None
    return b"".join(lines)


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte, back to the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` while the block runs (the library reads it during the load)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
