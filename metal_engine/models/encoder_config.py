"""What only the BERT-style encoders (BERT, XLM-RoBERTa) have, read from their config.json and
written back: post-norm LayerNorms, learned absolute positions, token types, and the
sequence-classification head of a cross-encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENCODERS = ("bert", "xlm-roberta")
# The activations of an encoder's MLP (not gated): transformers' names.
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# model_type -> (the base model class, the cross-encoder class): config.json's `architectures`.
ENCODER_ARCHITECTURES = {
    "bert": ("BertModel", "BertForSequenceClassification"),
    "xlm-roberta": ("XLMRobertaModel", "XLMRobertaForSequenceClassification"),
}
# What transformers assumes for keys a config.json leaves out.
DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": {"hidden_act": "gelu", "max_position_embeddings": 512, "pad_token_id": 0},
    "xlm-roberta": {"hidden_act": "gelu", "max_position_embeddings": 512, "pad_token_id": 1},
}


@dataclass(frozen=True)
class EncoderOptions:
    """`position_offset`: the first position's row of the position embeddings (XLM-RoBERTa
    counts positions from after its padding id). `num_labels` > 0: a cross-encoder, whose
    classifier head scores its first token's state."""

    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    position_offset: int = 0
    num_labels: int = 0
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.type_vocab_size < 1:
            raise ValueError(f"type_vocab_size must be at least 1, got {self.type_vocab_size}")

    @property
    def classifies(self) -> bool:
        return self.num_labels > 0

    def to_hf(self, model_type: str) -> dict[str, Any]:
        base, classifier = ENCODER_ARCHITECTURES[model_type]
        config: dict[str, Any] = {
            "architectures": [classifier if self.classifies else base],
            "layer_norm_eps": self.layer_norm_eps, "type_vocab_size": self.type_vocab_size,
            "pad_token_id": self.pad_token_id}
        if self.classifies:
            config["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
        return config


def read_encoder(cfg: dict[str, Any]) -> EncoderOptions:
    """The encoder's options; ValueError for what these encoders do not run (a BERT built
    as a decoder, relative position embeddings)."""
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError("config.json sets is_decoder / add_cross_attention: metal-serve runs "
                         "BERT-style models as bidirectional encoders only")
    positions = cfg.get("position_embedding_type", "absolute")
    if positions != "absolute":
        raise ValueError(f"config.json sets position_embedding_type={positions!r}: only "
                         "absolute position embeddings are supported")
    pad = cfg.get("pad_token_id") or 0
    architectures = cfg.get("architectures") or []
    classifies = any(a.endswith("ForSequenceClassification") for a in architectures)
    return EncoderOptions(
        layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
        type_vocab_size=cfg.get("type_vocab_size", 2),
        position_offset=pad + 1 if cfg["model_type"] == "xlm-roberta" else 0,
        num_labels=_num_labels(cfg) if classifies else 0,
        pad_token_id=pad,
    )


def _num_labels(cfg: dict[str, Any]) -> int:
    """transformers saves the label count as its `id2label` map (2 labels by default)."""
    labels = cfg.get("id2label")
    return len(labels) if labels else cfg.get("num_labels", 2)
