"""A fast tokenizer from a tiktoken BPE file (Kimi K2's and K2.5's `tiktoken.model`: a base64
token and its rank a line), built without the Python tokenizer class that ships beside it.

transformers' TikTokenConverter makes the byte-level BPE (vocabulary and merges by rank) from
ranks read here, so the `tiktoken` package is not needed. The one thing the code file holds
that the tokenizer needs, its split pattern (`pat_str`), is read from its source as string
literals and never run. Special tokens come from tokenizer_config.json's
`added_tokens_decoder`, at their ids after the base vocabulary; an id it skips is
`<|reserved_token_{id}|>`, as Kimi's code names it.
"""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path
from typing import Any

TIKTOKEN_FILE = "tiktoken.model"
# The token roles tokenizer_config.json may name, passed on to the fast tokenizer.
ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


def tiktoken_tokenizer(src: Path) -> Any:
    """`src`'s tokenizer (a PreTrainedTokenizerFast) from its tiktoken.model,
    tokenizer_config.json and the split pattern of the code its `auto_map` names."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    config = _tokenizer_config(src)
    ranks = read_ranks(src / TIKTOKEN_FILE)
    backend = RanksConverter(str(src / TIKTOKEN_FILE), split_pattern(src, config)).converted()
    backend.add_tokens([AddedToken(content, special=special, normalized=False)
                        for content, special in added_tokens(config, len(ranks))])
    roles = {role: _content(config[role]) for role in ROLES if config.get(role) is not None}
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=config.get(
        "chat_template"), extra_special_tokens=extra, **roles)


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file's tokens and ranks (tiktoken.load.load_tiktoken_bpe's format)."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise ValueError(f"{path}:{number} is not a base64 token and its rank: {exc}") from exc
    return ranks


def added_tokens(config: dict[str, Any], num_ranks: int) -> list[tuple[str, bool]]:
    """(content, special) of each id from `num_ranks` to the last that `added_tokens_decoder`
    lists, in id order."""
    decoder = {int(i): token for i, token in (config.get("added_tokens_decoder") or {}).items()}
    last = max(decoder, default=num_ranks - 1)
    return [(_content(decoder[i]), decoder[i].get("special", True))
            if isinstance(decoder.get(i), dict) else (f"<|reserved_token_{i}|>", True)
            for i in range(num_ranks, last + 1)]


def split_pattern(src: Path, config: dict[str, Any]) -> str:
    """The regex that splits text before BPE: tokenizer_config.json's `pat_str`, else the
    `pat_str` literal of the tokenizer module its `auto_map` names (read, not imported)."""
    if isinstance(config.get("pat_str"), str):
        return config["pat_str"]
    module = _auto_map_module(config)
    path = src / f"{module}.py" if module else None
    pattern = _pat_str_literal(path.read_text(encoding="utf-8")) if path and path.is_file() \
        else None
    if pattern is None:
        where = path.name if path else "its auto_map's module"
        raise ValueError(
            f"{src}: {TIKTOKEN_FILE} needs the regex that splits text before BPE, and no "
            f"`pat_str` string literal was found in tokenizer_config.json or in {where}. Add "
            "the tokenizer's pattern to tokenizer_config.json as \"pat_str\"")
    return pattern


def _pat_str_literal(source: str) -> str | None:
    """The value of the first `pat_str = ...` in `source` made of string literals only: a
    string, or `"sep".join([strings])`."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "pat_str"):
            return _string_of(node.value)
    return None


def _string_of(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "join" and len(node.args) == 1 and not node.keywords):
        separator = _string_of(node.func.value)
        try:
            parts = ast.literal_eval(node.args[0])
        except (ValueError, SyntaxError):
            return None
        if (separator is not None and isinstance(parts, (list, tuple))
                and all(isinstance(part, str) for part in parts)):
            return separator.join(parts)
    return None


def _auto_map_module(config: dict[str, Any]) -> str | None:
    """The module of `auto_map`'s AutoTokenizer class ("tokenization_kimi" for
    ["tokenization_kimi.TikTokenTokenizer", null])."""
    entry = (config.get("auto_map") or {}).get("AutoTokenizer")
    names = [entry] if isinstance(entry, str) else [n for n in entry or [] if isinstance(n, str)]
    return (names[0].rpartition(".")[0] or None) if names else None


def _tokenizer_config(src: Path) -> dict[str, Any]:
    path = src / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _content(token: str | dict[str, Any]) -> str:
    """A token as tokenizer_config.json writes it: its text, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else token
