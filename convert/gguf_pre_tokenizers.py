"""How text is split before BPE for the llama.cpp pre-tokenizers (a GGUF's `tokenizer.ggml.pre`)
that transformers' GGUF converters leave at GPT-2's split: those of the MLA families' files.

Each is the list of regexes llama.cpp splits by, one after the other, each splitting the
pieces the one before made (src/llama-vocab.cpp), which is what the models' own tokenizer.json
files say: GLM-4's is Llama 3's split, DeepSeek V3's three splits (digit runs of 3, CJK and
kana runs, the rest), Kimi K2's the `pat_str` of its tiktoken tokenizer (Han runs apart,
words split at case changes, contractions kept on the word).
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_KIMI_K2 = "|".join((
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))
SPLITS: dict[str, tuple[str, ...]] = {
    "glm4": (_LLAMA3,),
    "chatglm-bpe": (_LLAMA3,),
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": (_KIMI_K2,),
}


def set_llama_cpp_split(backend: Any, pre: str | None) -> None:
    """Give the byte-level `backend` (a tokenizers.Tokenizer) llama.cpp's split for `pre`, if
    it is one of SPLITS; others keep what transformers gave them."""
    from tokenizers import Regex, pre_tokenizers

    if pre not in SPLITS:
        return
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
