"""BERT and XLM-RoBERTa: bidirectional encoders (embedding models such as bge and MiniLM) and
their cross-encoders (`...ForSequenceClassification`, bge-reranker).

A step's rows are whole prompts (the scheduler never splits one: `SchedulerConfig.
whole_prompts`), and every row sees every key of its prompt: `AttentionMetadata.last_keys`
at the prompt's end. K/V still go through the paged pool like any model's. Layers are
post-norm: `h = LN(x + attn(x)); LN(h + mlp(h))`. Parameter names are the base model's
(`embeddings.*`, `encoder.layer.N.*`), the classifier's as transformers names it; a
cross-encoder's `bert.` / `roberta.` prefix is dropped at load.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels_metal.backends import device_ops_name
from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.layers import Linear, PackedLinears
from metal_engine.models.ops_user import OpsModel, OpsUser
from metal_engine.segments import split_segments

ACTIVATIONS = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx,
               "relu": nn.relu}
# What a checkpoint may hold that the encoder does not run: buffers, masked-LM heads.
_UNUSED = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.", "lm_head.")
_PREFIXES = ("bert.", "roberta.")


class Embeddings(nn.Module):
    """Word + learned position + token type embeddings, then a LayerNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        options = cfg.encoder
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(options.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=options.layer_norm_eps)
        self._offset = options.position_offset

    def __call__(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        ids, types = split_segments(input_ids)
        h = (self.word_embeddings(ids) + self.token_type_embeddings(types)
             + self.position_embeddings(positions + self._offset))
        return self.LayerNorm(h)


class SelfAttention(nn.Module, OpsUser):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        width = self.num_heads * self.head_dim
        self.query = Linear(cfg.hidden_size, width)
        self.key = Linear(cfg.hidden_size, width)
        self.value = Linear(cfg.hidden_size, width)
        self._qkv = PackedLinears(self, "query", "key", "value")

    def __call__(self, x: mx.array, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> mx.array:
        """`[total, heads x head_dim]`: each row over its prompt's keys (written into the
        layer's pool first)."""
        q, k, v = (y.reshape(x.shape[0], self.num_heads, self.head_dim)
                   for y in self.ops.linears(x, self._qkv))
        k_pool, v_pool = cache.take(pool)
        try:
            out, k_pool, v_pool = self.ops.write_and_attend(q, k, v, k_pool, v_pool, meta,
                                                            self.head_dim ** -0.5)
        finally:
            cache.put(pool, k_pool, v_pool)
        return out.reshape(x.shape[0], -1)


class DenseNorm(nn.Module):
    """`LN(x + dense(h))`: the output of an attention block or of an MLP."""

    def __init__(self, inner: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(inner, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.encoder.layer_norm_eps)

    def __call__(self, h: mx.array, x: mx.array) -> mx.array:
        return self.LayerNorm(x + self.dense(h))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg.hidden_size, cfg)

    def __call__(self, x, meta, cache, pool):
        return self.output(self.self(x, meta, cache, pool), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size)
        self._act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self._act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg.intermediate_size, cfg)

    def __call__(self, x, meta, cache, pool):
        h = self.attention(x, meta, cache, pool)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]


class Pooler(nn.Module):
    """BERT's: `tanh(dense(h))` of the first token, what its classifier reads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, h: mx.array) -> mx.array:
        return mx.tanh(self.dense(h))


class ClassificationHead(nn.Module):
    """XLM-RoBERTa's: `out_proj(tanh(dense(h)))` of the first token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = Linear(cfg.hidden_size, cfg.encoder.num_labels)

    def __call__(self, h: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(h)))


class Model(OpsModel):
    """`__call__` gives the last layer's states of every packed row; a cross-encoder's
    `logits` score its pooled first rows (`num_labels` each)."""

    mtp_class = None  # an encoder drafts nothing (`--speculative-config auto` asks)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        labels = cfg.encoder.num_labels
        if labels and cfg.model_type == "bert":  # keep in step with `checkpoint_name`
            self.pooler = Pooler(cfg)
            self.classifier = Linear(cfg.hidden_size, labels)
        elif labels:
            self.classifier = ClassificationHead(cfg)
        self._pools = [cfg.kv_pool(i) for i in range(cfg.num_hidden_layers)]
        self.use_ops(device_ops_name())

    def __call__(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata,
                 cache: KVCache, images=None) -> mx.array:
        """`images`: always None (an encoder reads text only)."""
        meta = whole_prompts(meta)
        h = self.embeddings(input_ids, positions)
        for layer, pool in zip(self.encoder.layer, self._pools, strict=True):
            h = layer(h, meta, cache, pool)
        return h

    @property
    def has_head(self) -> bool:
        """A cross-encoder's classifier; an embedding encoder has no head."""
        return "classifier" in self

    def drop_head(self) -> None:
        """Nothing to drop: an encoder has no LM head."""

    def logits(self, hidden: mx.array) -> mx.array:
        """The classifier's scores of pooled first-token states `[n, hidden]`."""
        if "pooler" in self:
            return self.classifier(self.pooler(hidden))
        return self.classifier(hidden)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The checkpoint's tensors under this model's names (`checkpoint_name`)."""
        renamed = {name: checkpoint_name(name, self.config) for name in weights}
        return {new: weights[name] for name, new in renamed.items() if new is not None}


def whole_prompts(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with every row seeing its whole prompt. Each request's rows must be its whole
    prompt, from position 0 (a prompt split over steps would see only part of itself)."""
    q_lens = np.diff(meta.cu_seqlens_q)
    if (q_lens != meta.seq_lens).any():
        raise RuntimeError("an encoder computes each prompt whole in one step: schedule it "
                           "with SchedulerConfig.whole_prompts")
    return meta.with_last_keys(np.repeat(meta.seq_lens.astype(np.int64) - 1, q_lens))


def checkpoint_name(name: str, cfg: ModelConfig) -> str | None:
    """A checkpoint tensor's name here: a cross-encoder's `bert.` / `roberta.` prefix dropped,
    old checkpoints' LayerNorm `gamma` / `beta` as `weight` / `bias`; None for what the
    encoder does not run (buffers, masked-LM heads, a pooler that no classifier reads)."""
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    if ".LayerNorm." in name:
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
    reads_pooler = cfg.encoder.classifies and cfg.model_type == "bert"
    unused = _UNUSED if reads_pooler else (*_UNUSED, "pooler.")
    return None if name.startswith(unused) else name
