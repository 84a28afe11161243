"""A GGUF file's tokenizer, rebuilt from its metadata without PyTorch.

transformers turns `tokenizer.ggml.*` metadata into a fast tokenizer with its GGUF
converters, but its own way in (`from_pretrained(..., gguf_file=...)`) goes through a GGUF
reader that imports torch, which serving does not install. Here the `gguf` package reads the
metadata and transformers' converters build the tokenizer from it, as transformers would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

from convert.gguf_pre_tokenizers import set_llama_cpp_split

# llama.cpp's names for special token ids -> transformers' special token attributes.
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def gguf_tokenizer(gguf_path: Path) -> Any:
    """A `PreTrainedTokenizerFast` for the tokenizer the file's metadata describes."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    reader = GGUFReader(gguf_path)
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if name.startswith("tokenizer.") or name == "general.architecture"}
    grouped = {
        group: {attr: metadata[f"tokenizer.{key}"] for key, attr in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer:
        raise ValueError(f"{gguf_path} has no tokenizer.ggml.tokens metadata")
    if tokenizer.get("tokenizer_type") == "llama":
        # Older files have no flag; llama.cpp adds BOS to a sentencepiece vocabulary.
        config.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    if tokenizer.get("tokenizer_type") == "gpt2":  # byte-level BPE
        set_llama_cpp_split(backend, tokenizer.get("pre_tokenizer_type"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
