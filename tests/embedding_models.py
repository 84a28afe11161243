"""Tiny random embedding and reranker checkpoints, saved as their real ones are.

The embedding model is a Qwen3 base model (`Qwen3Model`: no LM head, tensors without the
`model.` prefix) with sentence-transformers' files beside it, as Qwen3-Embedding ships. The
reranker is a Qwen3 causal LM whose vocabulary has the words "yes" and "no", as
Qwen3-Reranker's has. Both tokenize words split on whitespace. An embedding's reference is
sentence-transformers' own over the saved dir (`sentence_embeddings`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from tiny_models import COMMON, TINY_MODELS, VOCAB, build_tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers

YES, NO = 5, 6  # the reranker's "yes" and "no" ids
EOS = 2


def word_tokenizer(path: Path, words: dict[str, int] | None = None) -> None:
    """Words `w0` .. `w127` (and `words`) split on whitespace; unknown ones are `w0`."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    for word, token_id in (words or {}).items():
        vocab[word] = token_id
        vocab.pop(f"w{token_id}")
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    # Else transformers builds the family's own tokenizer class, which reads no word level.
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0"}))


def build_embedding_model(path: Path, pooling: str = "lasttoken", normalize: bool = True,
                          prompts: dict[str, str] | None = None):
    """Save a tiny Qwen3 embedding model with its sentence-transformers files; return the
    float32 transformers base model (the reference)."""
    _, _, overrides = TINY_MODELS["qwen3"]
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**COMMON, **overrides})
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # norms off 1, so a misread one shows
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(path)
    write_sentence_transformers_files(path, config.hidden_size, pooling, normalize)
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}))
    return model


def write_sentence_transformers_files(path: Path, hidden_size: int, pooling: str,
                                      normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers writes them: a
    transformer, its `pooling` ("cls_token", "mean_tokens", "max_tokens" or "lasttoken"),
    then L2 normalization if `normalize`."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    modes = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden_size,
         **{f"pooling_mode_{m}": m == pooling for m in modes}}))


def build_reranker(path: Path):
    """Save a tiny Qwen3 causal LM as a reranker ("yes" and "no" in its vocabulary); return
    the float32 transformers model."""
    model = build_tiny_model("qwen3", path)
    word_tokenizer(path, {"yes": YES, "no": NO})
    return model


def sentence_embeddings(path: Path, texts: list[str], **options) -> np.ndarray:
    """sentence-transformers' embeddings of `texts` by the model saved in `path`, its pipeline
    (pooling, normalization, named prompts) read from the dir's files as it reads them;
    `options`: `encode`'s (`prompt_name`, `truncate_dim`)."""
    from sentence_transformers import SentenceTransformer  # imported here: it takes seconds

    model = SentenceTransformer(str(path), device="cpu")
    if model.tokenizer.pad_token is None:  # the word tokenizers have none; it pads batches
        model.tokenizer.pad_token = model.tokenizer.unk_token
    return model.encode(texts, **options)


def hidden_states(model, ids: list[int]) -> torch.Tensor:
    """The base model's final hidden states (after its norm) of one prompt, `[len, hidden]`."""
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].float()
