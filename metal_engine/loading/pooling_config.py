"""What a model dir serves (`--task`, else what its files say), and how it pools: read from the
sentence-transformers files beside the checkpoint.

    modules.json                      the pipeline: ...Pooling at 1_Pooling, ...Normalize (L2)
    1_Pooling/config.json             pooling_mode_lasttoken / _mean_tokens / _cls_token
    config_sentence_transformers.json prompts by name (e.g. "query": "Instruct: ...\\nQuery:")

`--task auto` (the default) reads the checkpoint: a cross-encoder (`...ForSequenceClassification`)
serves rerank scores; a dir with sentence-transformers files, an encoder without a head, or a
causal LM's checkpoint without an LM head (Qwen3-Embedding's: last-token pooling, normalized)
serves embeddings; any other model generates. A causal LM served with `--task rerank` scores
pairs as Qwen3-Reranker does (server/openai/rerank_prompt.py). The same rule answers for a
model not loaded yet (`task_from_files`: a server's card of it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from metal_engine.config import Task
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.weight_bytes import safetensors_headers
from metal_engine.loading.weights import has_lm_head, safetensors_files, text_model_name
from scheduler.pooling_params import PoolingKind

PoolingTask = Literal["embed", "rerank"]
ServedTask = Literal["generate", "embed", "rerank"]
# How a reranker scores a pair: a causal LM's "yes" against "no" over Qwen3-Reranker's
# template, or a cross-encoder's classifier over the tokenizer's pair encoding.
Scorer = Literal["yes_no", "classifier"]
# sentence-transformers' pooling modes -> ours; its others (max, weighted mean) are refused.
_MODES: dict[str, PoolingKind] = {"pooling_mode_lasttoken": "last",
                                  "pooling_mode_mean_tokens": "mean",
                                  "pooling_mode_cls_token": "cls"}
# A cross-encoder's score activation as sentence-transformers names it in config.json.
_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": True,
                "torch.nn.modules.linear.Identity": False}


@dataclass(frozen=True)
class PoolingConfig:
    """How a pooling model's requests pool: `kind`, L2-normalized or not, its named prompts
    (prefixes a request may ask for by name), and for a reranker how it scores a pair
    (`sigmoid`: a classifier's logit through the sigmoid, as sentence-transformers' default
    for one label)."""

    task: PoolingTask
    kind: PoolingKind = "last"
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    scorer: Scorer = "yes_no"
    sigmoid: bool = False


def read_pooling_config(model_dir: Path, task: Task, config: ModelConfig,
                        has_head: bool) -> PoolingConfig | None:
    """The dir's pooling config for `task`; None for a model that generates. `has_head`: the
    model's LM head (a decoder) or classifier (an encoder). ValueError for a task the model
    cannot serve, saying which it can."""
    model_dir = Path(model_dir)
    task = _resolved_task(task, model_dir, config, has_head)
    encoder = config.encoder
    if task == "generate":
        if encoder is not None or not has_head:
            raise ValueError("the model has no LM head, so it cannot generate: serve it with "
                             "--task embed (or rerank for a cross-encoder)")
        return None
    if task == "rerank":
        return _reranker(model_dir, config, has_head)
    if encoder is not None and encoder.classifies:
        raise ValueError("a cross-encoder scores (query, document) pairs, it does not embed: "
                         "serve it with --task rerank")
    if (model_dir / "modules.json").is_file():
        return _sentence_transformers(model_dir)
    if encoder is not None:  # as sentence-transformers wraps a bare encoder
        return PoolingConfig("embed", "mean", normalize=False)
    return PoolingConfig("embed")


def task_from_files(model_dir: Path, task: Task, config: ModelConfig) -> ServedTask:
    """What the model in `model_dir` serves under `task`, read from its files without loading
    a weight (its safetensors headers say whether it has an LM head): the task its loaded
    engine will serve, for a server to list before loading it."""
    model_dir = Path(model_dir)
    if config.encoder is not None:
        has_head = config.encoder.classifies
    else:
        names = (text_model_name(n) or "" for n in
                 safetensors_headers(safetensors_files(model_dir)))
        has_head = has_lm_head(config, names)
    return _resolved_task(task, model_dir, config, has_head)


def _resolved_task(task: Task, model_dir: Path, config: ModelConfig,
                   has_head: bool) -> ServedTask:
    if task == "score":
        return "rerank"
    if task != "auto":
        return task
    if config.encoder is not None and config.encoder.classifies:
        return "rerank"
    if config.encoder is not None or not has_head or (model_dir / "modules.json").is_file():
        return "embed"
    return "generate"


def _reranker(model_dir: Path, config: ModelConfig, has_head: bool) -> PoolingConfig:
    encoder = config.encoder
    if encoder is None:
        if not has_head:
            raise ValueError("the model has no LM head to read 'yes' and 'no' from: a "
                             "reranker is a causal LM (Qwen3-Reranker) or a cross-encoder")
        return PoolingConfig("rerank")
    if not encoder.classifies:
        raise ValueError("the encoder has no classifier head to score pairs with: serve it "
                         "with --task embed")
    if encoder.num_labels != 1:
        raise ValueError(f"the cross-encoder has {encoder.num_labels} labels; a rerank score "
                         "is one (a checkpoint with num_labels 1)")
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return PoolingConfig("rerank", "cls", normalize=False, scorer="classifier",
                         sigmoid=_score_activation(raw))


def _score_activation(raw: dict[str, Any]) -> bool:
    """Whether scores go through the sigmoid: what sentence-transformers' CrossEncoder reads
    from config.json (v4's `sentence_transformers.activation_fn`, older versions'
    `sbert_ce_default_activation_function`), else its default for one label (sigmoid)."""
    name = (raw.get("sentence_transformers") or {}).get("activation_fn") or raw.get(
        "sbert_ce_default_activation_function")
    if name is None:
        return True
    if name not in _ACTIVATIONS:
        raise ValueError(f"config.json's cross-encoder activation {name!r} is not supported "
                         f"(supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def sentence_transformers_files(model_dir: Path) -> list[Path]:
    """The sentence-transformers files of a dir (relative paths) that say how it pools: what a
    conversion keeps beside the weights."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return []
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    files = [Path("modules.json"), Path("config_sentence_transformers.json"),
             *(Path(m["path"]) / "config.json" for m in modules if m.get("path"))]
    return [f for f in files if (Path(model_dir) / f).is_file()]


def _sentence_transformers(model_dir: Path) -> PoolingConfig:
    modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
    kind: PoolingKind = "last"
    normalize = False
    for module in modules:
        kind_name = module.get("type", "").rsplit(".", 1)[-1]
        if kind_name == "Normalize":
            normalize = True
        elif kind_name == "Pooling":
            kind = _pooling_kind(model_dir / module.get("path", "") / "config.json")
    prompts_file = model_dir / "config_sentence_transformers.json"
    prompts = {}
    if prompts_file.is_file():
        prompts = json.loads(prompts_file.read_text(encoding="utf-8")).get("prompts") or {}
    return PoolingConfig("embed", kind, normalize, dict(prompts))


def _pooling_kind(path: Path) -> PoolingKind:
    config = json.loads(path.read_text(encoding="utf-8"))
    chosen = [kind for mode, kind in _MODES.items() if config.get(mode)]
    others = [mode for mode, on in config.items()
              if mode.startswith("pooling_mode_") and on and mode not in _MODES]
    if others or len(chosen) != 1:
        raise ValueError(f"{path} asks for pooling {others or chosen}; metal-serve pools by "
                         "exactly one of last token, mean or CLS")
    return chosen[0]
