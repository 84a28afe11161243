"""Whether a model dir serves embeddings or rerank scores, and how it pools: read from the
sentence-transformers files beside the checkpoint.

    modules.json                      the pipeline: ...Pooling at 1_Pooling, ...Normalize (L2)
    1_Pooling/config.json             pooling_mode_lasttoken / _mean_tokens / _cls_token
    config_sentence_transformers.json prompts by name (e.g. "query": "Instruct: ...\\nQuery:")

A dir with these serves embeddings; so does a checkpoint without an LM head (last-token pooling,
normalized: Qwen3-Embedding's). A causal LM whose dir or served name says "reranker" serves
rerank scores as Qwen3-Reranker computes them (server/openai/rerank_prompt.py). Any other model
generates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from scheduler.pooling_params import PoolingKind

PoolingTask = Literal["embed", "rerank"]
# sentence-transformers' pooling modes -> ours; its others (max, weighted mean) are refused.
_MODES: dict[str, PoolingKind] = {"pooling_mode_lasttoken": "last",
                                  "pooling_mode_mean_tokens": "mean",
                                  "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    """How a pooling model's requests pool: `kind`, L2-normalized or not, and its named
    prompts (prefixes a request may ask for by name)."""

    task: PoolingTask
    kind: PoolingKind = "last"
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)


def read_pooling_config(model_dir: Path, name: str, has_head: bool) -> PoolingConfig | None:
    """The dir's pooling config; None for a model that generates. `name`: its served name."""
    model_dir = Path(model_dir)
    if (model_dir / "modules.json").is_file():
        return _sentence_transformers(model_dir)
    if not has_head:
        return PoolingConfig("embed")
    if has_head and any("reranker" in n.lower() for n in (model_dir.name, name)):
        return PoolingConfig("rerank")
    return None


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
