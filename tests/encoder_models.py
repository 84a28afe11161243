"""Tiny random BERT and XLM-RoBERTa checkpoints, saved as their real ones are: an embedding
model (the base model, sentence-transformers' files beside it, as bge / all-MiniLM ship) and a
cross-encoder (`...ForSequenceClassification` with one label, as bge-reranker ships), each with
its family's tokenizer (BERT's WordPiece with token types, XLM-R's unigram without) over the
words `w5` .. `w127`.

The references are sentence-transformers' own over the saved dirs: an embedding is its
SentenceTransformer's (embedding_models.sentence_embeddings), a score its CrossEncoder's (the
classifier's logit through the activation config.json names); a raw score is transformers'
classifier logit over the tokenizer's pair encoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from embedding_models import write_sentence_transformers_files

FAMILIES = ("bert", "xlm-roberta")
VOCAB = 128
MAX_POSITIONS = 64  # the encoder's positions (XLM-R's table has 2 more rows: it counts from 2)
_SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 96}
_CLASSES = {
    "bert": (transformers.BertConfig, transformers.BertModel,
             transformers.BertForSequenceClassification),
    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                    transformers.XLMRobertaForSequenceClassification),
}


def _save(family: str, path: Path, cross_encoder: bool):
    config_class, base, classifier = _CLASSES[family]
    offset = 2 if family == "xlm-roberta" else 0
    config = config_class(**_SHAPE, max_position_embeddings=MAX_POSITIONS + offset,
                          num_labels=1)
    torch.manual_seed(0)
    model = (classifier if cross_encoder else base)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # norms off 1, biases off 0: a misread one shows
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(family).save_pretrained(path)
    return model


def _tokenizer(family: str):
    words = [f"w{i}" for i in range(5, VOCAB)]
    if family == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        return transformers.BertTokenizer(vocab={w: i for i, w in enumerate(specials + words)})
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("<mask>", 0.0)]
    return transformers.XLMRobertaTokenizer(vocab=pieces + [(f"\u2581{w}", -1.0) for w in words])


def build_embedding_encoder(family: str, path: Path, pooling: str = "cls",
                            normalize: bool = True) -> None:
    """Save a tiny embedding encoder with sentence-transformers' files (`pooling`: "cls" or
    "mean")."""
    _save(family, path, cross_encoder=False)
    modes = {"cls": "cls_token", "mean": "mean_tokens"}
    write_sentence_transformers_files(path, _SHAPE["hidden_size"], modes[pooling], normalize)


def build_cross_encoder(family: str, path: Path, activation: str | None = None):
    """Save a tiny cross-encoder (one label); `activation`: the score activation its
    config.json names for sentence-transformers (None: its default). Returns the float32
    transformers model."""
    model = _save(family, path, cross_encoder=True)
    if activation is not None:
        config = json.loads((path / "config.json").read_text())
        config["sentence_transformers"] = {"activation_fn": activation}
        (path / "config.json").write_text(json.dumps(config))
    return model


def tokenizer_of(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def cross_encoder_scores(path: Path, query: str, documents: list[str]) -> list[float]:
    """sentence-transformers' CrossEncoder scores of (query, document) pairs by the model
    saved in `path`: its logit through the activation its config.json names (else sigmoid)."""
    from sentence_transformers import CrossEncoder  # imported here: it takes seconds

    model = CrossEncoder(str(path), device="cpu")
    return model.predict([(query, document) for document in documents]).tolist()


def pair_logit(model, tokenizer, query: str, document: str) -> float:
    """The cross-encoder's raw score of one pair, as transformers computes it."""
    encoded = tokenizer(query, document, return_tensors="pt")
    with torch.no_grad():
        return model(**encoded).logits[0, 0].item()
