"""`--speculative-config auto` for a model dir: drafting with the checkpoint's MTP head where
the dir carries one metal-serve runs, by prompt lookup (the `suffix` method) otherwise.

Decided from config.json and the safetensors headers (nothing is loaded), so the memory plan
before loading and the engine agree on it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from metal_engine.loading.model_config import ModelConfig, read_config_json
from metal_engine.loading.weight_bytes import safetensors_headers
from metal_engine.loading.weights import MTP_PREFIX, safetensors_files
from metal_engine.models.registry import model_class

if TYPE_CHECKING:
    from pathlib import Path

    from metal_engine.config import EngineConfig


def resolve_speculative(config: EngineConfig) -> EngineConfig:
    """`config` with `auto` replaced by the method it runs on this model; as it is otherwise."""
    spec = config.speculative_config
    if spec is None or spec.method != "auto":
        return config
    # Several ranks run the host's methods only (EngineConfig._check_parallel).
    mtp_head = config.parallel_size == 1 and has_mtp_head(config.model_dir)
    return replace(config, speculative_config=spec.resolved(mtp_head=mtp_head))


def has_mtp_head(model_dir: Path) -> bool:
    """Whether the dir holds an MTP head `load_mtp_head` takes: a family with a head class,
    one layer (`mtp_num_hidden_layers`), float `mtp.*` weights, experts not fused."""
    if not (model_dir / "config.json").is_file():
        return False
    try:
        model_type = ModelConfig.from_model_dir(model_dir).model_type
        if model_class(model_type).mtp_class is None:
            return False
        names = safetensors_headers(safetensors_files(model_dir))
    except (ValueError, OSError):
        return False  # loading the model names what is wrong with it
    raw = read_config_json(model_dir)
    head = [name for name in names if name.startswith(MTP_PREFIX)]
    return (raw.get("text_config", raw).get("mtp_num_hidden_layers", 0) == 1 and bool(head)
            and not any(n.endswith(".scales") or ".experts.gate_up_proj" in n for n in head))
