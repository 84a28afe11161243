"""Tokenizer files for a model dir: copied from a Hugging Face dir or rebuilt from GGUF metadata."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from convert.gguf_tokenizer import gguf_tokenizer
from convert.tiktoken_vocab import TIKTOKEN_FILE, tiktoken_tokenizer
from metal_engine.loading.tokenizer_loading import (
    CustomCodeRefused,
    files_with_auto_map,
    load_tokenizer,
)

# Copied as-is when present; generation_config.json rides along for its sampling defaults.
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# Options of the load that produced the files, saved along by transformers 5; not tokenizer facts.
LOAD_OPTIONS = ("is_local", "local_files_only")


def copy_hf_tokenizer(src: Path, dst: Path) -> None:
    """Copy a Hugging Face dir's tokenizer files; build tokenizer.json if only a slow one (or
    a tiktoken file, as Kimi's) exists."""
    for name in HF_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if files_with_auto_map(src) and (dst / "tokenizer.json").exists():
        # Refused here, not when served: a tokenizer that loads only with the source's code.
        load_tokenizer(src, local_files_only=True)
    if not (dst / "tokenizer.json").exists():
        if (src / TIKTOKEN_FILE).is_file():
            tiktoken_tokenizer(src).save_pretrained(dst)
        elif (src / "tokenizer.model").exists():
            _save_with_transformers(src, dst)
        else:
            raise ValueError(
                f"{src} has no tokenizer (tokenizer.json, tokenizer.model or {TIKTOKEN_FILE}); "
                "copy the model's tokenizer files into it"
            )
    finalize_tokenizer_config(dst)


def write_gguf_tokenizer(gguf_path: Path, dst: Path, eos_token_id: int | None) -> None:
    """Rebuild the tokenizer (with chat template) from GGUF metadata and save it into dst."""
    _save_tokenizer(partial(gguf_tokenizer, gguf_path), gguf_path, dst, eos_token_id)
    finalize_tokenizer_config(dst)


def _save_with_transformers(folder: Path, dst: Path) -> None:
    _save_tokenizer(partial(load_tokenizer, folder, local_files_only=True), folder, dst)


def _save_tokenizer(load: Callable[[], Any], source: Path, dst: Path,
                    eos_id: int | None = None) -> None:
    # transformers raises assorted exception types for tokenizer kinds it cannot convert.
    try:
        tokenizer = load()
    except CustomCodeRefused:
        raise  # says what to do already
    except Exception as exc:
        raise ValueError(
            f"could not build a tokenizer from {source}: {exc}. The source needs a tokenizer "
            "transformers can load (a GGUF with tokenizer.ggml.* metadata, or tokenizer.json)"
        ) from exc
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    tokenizer.save_pretrained(dst)


def finalize_tokenizer_config(folder: Path) -> None:
    """Put the chat template into tokenizer_config.json, where every loader looks for it."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if "chat_template" not in config:
        template = _read_chat_template(folder)
        if template is not None:
            config["chat_template"] = template
    # transformers 4 and mlx-lm know the fast tokenizer only by its old class name.
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in LOAD_OPTIONS:
        config.pop(key, None)
    # Code files are never copied: an auto_map could only name missing code (or a Hub repo's).
    config.pop("auto_map", None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _read_chat_template(folder: Path) -> Any:
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").exists():
        data = json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))
        return data.get("chat_template")
    return None
