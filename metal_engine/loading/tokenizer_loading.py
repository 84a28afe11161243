"""Load a model dir's tokenizer without ever running code from the dir.

An `auto_map` in tokenizer_config.json or config.json names Python classes for transformers to
import from the dir (or from a Hub repo). Left to itself, transformers asks "Do you wish to run
the custom code? [y/N]" on stdin and runs it on a "y". Every load here passes
`trust_remote_code=False`: a tokenizer that transformers builds from its own classes (a
tokenizer.json) loads and the auto_map is ignored; one that needs the dir's code is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The files whose `auto_map` makes transformers look for custom code.
AUTO_MAP_FILES = ("tokenizer_config.json", "config.json")


class CustomCodeRefused(ValueError):
    """The model dir's tokenizer loads only by running Python code that ships with the dir."""


def load_tokenizer(model_dir: Path | str, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained(model_dir)` with the dir's own code never run.

    Raises CustomCodeRefused, naming the file with the `auto_map`, when the tokenizer cannot be
    built without that code; other load errors pass through unchanged."""
    from transformers import AutoTokenizer  # imported here: it takes seconds to import

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False, **kwargs)
    except ValueError as exc:
        files = files_with_auto_map(Path(model_dir))
        # transformers' refusal of custom code tells how to allow it; other errors pass through.
        if not files or "trust_remote_code" not in str(exc):
            raise
        where = " and ".join(files) + (" has" if len(files) == 1 else " have")
        raise CustomCodeRefused(
            f"{model_dir}: the tokenizer needs custom Python code ({where} an `auto_map`), "
            "and metal-serve never runs code from a model dir. Use a checkpoint "
            "whose tokenizer is a standard transformers class (one with a tokenizer.json), or "
            "set `tokenizer_class` in tokenizer_config.json to a transformers tokenizer and "
            "remove the `auto_map`"
        ) from exc  # transformers' own message says to pass trust_remote_code=True: not an option


def files_with_auto_map(model_dir: Path) -> list[str]:
    """The names of AUTO_MAP_FILES in `model_dir` that carry an `auto_map`."""
    found = []
    for name in AUTO_MAP_FILES:
        path = model_dir / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError):
            continue  # unreadable: transformers' own error says so
        if isinstance(data, dict) and data.get("auto_map"):
            found.append(name)
    return found
