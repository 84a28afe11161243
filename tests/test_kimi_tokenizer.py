"""Kimi K2 / K2.5's tokenizer: a `tiktoken.model` (base64 token and rank a line), a
tokenization_kimi.py that builds a tiktoken Encoding with its own split pattern, and an
auto_map naming it; no tokenizer.json. Conversion builds the tokenizer.json from those files
without running the code, and it encodes as tiktoken does with Kimi's pattern and specials.

The vocabulary here is a small byte-level BPE trained on a few lines under that pattern; the
reference is tiktoken itself (what Kimi's own class runs).
"""

from __future__ import annotations

import base64
import collections
import json
import shutil
from pathlib import Path

import pytest
import regex
from tiny_models import build_tiny_model

from convert import convert_model
from convert.tiktoken_vocab import _pat_str_literal
from metal_engine.loading.tokenizer_loading import load_tokenizer

tiktoken = pytest.importorskip("tiktoken", reason="tiktoken (the dev extra) is not installed")

# Kimi's split pattern, as its tokenization_kimi.py writes it (`&&` intersects classes).
KIMI_PATTERN = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]  # fmt: skip
CORPUS = ("Hello world! The tokenizer's words, THE WORDS and 12345 digits.\n\n"
          "你好世界，中文的词。  Tabs\tand  spaces; they're here: def f(x): return x")
# The special tokens' offsets after the base vocabulary, as Kimi's config lists them; 5 is
# left out (a reserved token), <|tool_call_begin|> is not special (decoded for the parser).
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
            6: "<|tool_call_begin|>", 7: "[PAD]"}
TEMPLATE = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
# Written by tokenization_kimi.py's first line if anything ever imports it.
MARKER = "code-ran"


def trained_ranks(text: str) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair of the pieces
    Kimi's pattern splits `text` into, merged, until each piece is one token (so that a piece
    split otherwise encodes otherwise)."""
    ranks = {bytes([b]): b for b in range(256)}
    split = regex.compile("|".join(KIMI_PATTERN), regex.V1)  # V1: `&&` intersects
    pieces = [[bytes([b]) for b in piece.encode()] for piece in split.findall(text)]
    while any(len(piece) > 1 for piece in pieces):
        pairs = collections.Counter(pair for piece in pieces
                                    for pair in zip(piece, piece[1:], strict=False))
        (left, right), _ = pairs.most_common(1)[0]
        ranks.setdefault(left + right, len(ranks))
        pieces = [_merged(piece, left, right) for piece in pieces]
    return ranks


def _merged(piece: list[bytes], left: bytes, right: bytes) -> list[bytes]:
    out: list[bytes] = []
    for part in piece:
        if out and out[-1] == left and part == right:
            out[-1] = left + right
        else:
            out.append(part)
    return out


def kimi_source(root: Path, ranks: dict[bytes, int], module: str | None) -> Path:
    """A tiny Kimi K2 checkpoint (DeepSeek V3's text model) with Kimi's tokenizer files;
    `module`: the source of its tokenization_kimi.py."""
    source = root / "hf"
    build_tiny_model("deepseek_v3", source)
    (source / "tokenizer.json").unlink()
    lines = (base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items())
    (source / "tiktoken.model").write_bytes(b"".join(lines))
    base = len(ranks)
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": None,
        "added_tokens_decoder": {
            str(base + offset): {"content": content, "special": content != "<|tool_call_begin|>",
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "single_word": False}
            for offset, content in SPECIALS.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>"],
        "chat_template": TEMPLATE,
    }  # fmt: skip
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    if module is not None:
        (source / "tokenization_kimi.py").write_text(module)
    return source


def kimi_module(marker: Path, pattern: list[str] | None) -> str:
    """A tokenization_kimi.py whose import writes `marker`, with Kimi's `pat_str` (if any)."""
    lines = ["from pathlib import Path", f"Path({str(marker)!r}).write_text('ran')", "",
             "class TikTokenTokenizer:", "    num_reserved_special_tokens = 256"]
    if pattern is not None:
        lines += ["    pat_str = \"|\".join(", "        ["]
        lines += [f'            r"""{part}""",' for part in pattern]
        lines += ["        ]", "    )"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return trained_ranks(CORPUS)


def test_kimis_tiktoken_files_convert_to_a_tokenizer_that_encodes_as_tiktoken(tmp_path, ranks):
    source = kimi_source(tmp_path, ranks, kimi_module(tmp_path / MARKER, KIMI_PATTERN))
    out = convert_model(source, tmp_path / "out", progress=False)
    tokenizer = load_tokenizer(out)  # as serving loads it
    base = len(ranks)
    specials = {content: base + offset for offset, content in SPECIALS.items()}
    reference = tiktoken.Encoding("kimi", pat_str="|".join(KIMI_PATTERN), mergeable_ranks=ranks,
                                  special_tokens={**specials, f"<|reserved_token_{base + 5}|>":
                                                  base + 5})  # fmt: skip
    for text in (CORPUS, "Hello<|im_end|>你好 world\n\n\n  x", "Unseen ÜBER naïve 7890123 ça"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        base, base + 1, base + 7)
    assert tokenizer.convert_ids_to_tokens(base + 5) == f"<|reserved_token_{base + 5}|>"
    # Special tokens leave decoded text; the tool-call marker, not special, stays for the parser.
    assert tokenizer.decode([base + 6, base + 2, ranks[b"H"]], skip_special_tokens=True) == (
        "<|tool_call_begin|>H")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello world"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_user|>Hello world<|im_end|><|im_assistant|>"
    assert reference.encode(prompt, allowed_special="all")[0] == specials["<|im_user|>"]
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in saved and saved["chat_template"] == TEMPLATE
    assert (out / "tokenizer.json").is_file() and not (out / "tokenization_kimi.py").exists()
    assert not (tmp_path / MARKER).exists()  # the code was read, never imported


@pytest.mark.parametrize("module", ["without-pattern", "missing"])
def test_a_tiktoken_file_without_a_readable_split_pattern_is_refused(tmp_path, ranks, module):
    code = kimi_module(tmp_path / MARKER, None) if module == "without-pattern" else None
    source = kimi_source(tmp_path, ranks, code)
    with pytest.raises(ValueError, match='no `pat_str` string literal .* as "pat_str"'):
        convert_model(source, tmp_path / "out", progress=False)
    assert not (tmp_path / MARKER).exists() and not (tmp_path / "out").exists()
    # The pattern given in tokenizer_config.json is enough.
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["pat_str"] = "|".join(KIMI_PATTERN)
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    tokenizer = load_tokenizer(convert_model(source, tmp_path / "out", progress=False))
    assert tokenizer.encode(CORPUS, add_special_tokens=False) == tiktoken.Encoding(
        "kimi", pat_str=config["pat_str"], mergeable_ranks=ranks, special_tokens={}).encode(
        CORPUS)


@pytest.mark.parametrize(("assignment", "pattern"), [
    ('pat_str = r"\\w+|\\s+"', r"\w+|\s+"),
    ('pat_str = "|".join([r"\\w+", "x"])', r"\w+|x"),
    ('pat_str = "|".join(("a", "b"))', "a|b"),
    ('pat_str = "|".join("ab")', None),  # a string's characters: not the pattern meant
    ('pat_str = "|".join({"a"})', None),  # a set: no order
    ('pat_str = "|".join([part for part in PARTS])', None),  # not literals
    ('pat_str = "|".join(["a", 1])', None),
])
def test_only_a_string_or_a_joined_list_of_strings_is_read_as_the_pattern(assignment, pattern):
    assert _pat_str_literal(f"class TikTokenTokenizer:\n    {assignment}\n") == pattern
