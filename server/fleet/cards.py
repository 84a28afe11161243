"""`/v1/models` cards for a server of several models: a loaded model's from its engine, an
unloaded one's from its files (read once)."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path

from metal_engine.config import Task
from server.fleet.catalog import ModelEntry
from server.openai.protocol import ModelCard

log = logging.getLogger("metal_serve")


def unloaded_card(entry: ModelEntry, created: int, **extra: object) -> ModelCard:
    """What the model's dir says of it before it loads: its trained context, parameters and
    capabilities (those of a loaded model are its engine's). A .gguf or hub reference says
    nothing until loaded."""
    return ModelCard(id=entry.name, created=created, **_from_files(entry.reference, entry.task),
                     **extra)


@cache
def _from_files(reference: str | None, task: Task) -> dict:
    if reference is None:  # the bundled default model: a chat model
        return {"capabilities": ["completion", "chat"]}
    path = Path(reference).expanduser()
    if not (path / "config.json").is_file():
        return {}
    from metal_engine.loading.model_config import ModelConfig
    from metal_engine.loading.parameter_count import count_parameters
    from metal_engine.loading.pooling_config import task_from_files

    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    try:
        config = ModelConfig.from_dict(raw)
        counts = count_parameters(config)
        served = task_from_files(path, task, config)
    except (ValueError, KeyError, TypeError, OSError) as exc:  # loading will say what is wrong
        log.warning("model %s: its files cannot be read: %s", path, exc)
        return {}
    return {"max_model_len": config.trained_context_len, "num_parameters": counts.total,
            "active_parameters": counts.active, "capabilities": _capabilities(path, raw, served)}


def _capabilities(path: Path, raw: dict, served: str) -> list[str]:
    """As a loaded model's engine lists them (server.app)."""
    from server.core.tool_plan import takes_tools

    if served != "generate":
        return ["embeddings" if served == "embed" else "rerank"]
    capabilities = ["completion"]
    template = _chat_template(path)
    if template:
        capabilities += ["chat", "tools"] if takes_tools(template) else ["chat"]
    return capabilities + (["vision"] if "vision_config" in raw else [])


def _chat_template(path: Path) -> str | None:
    """The dir's chat template text (all of them, for named templates), where transformers'
    AutoTokenizer looks for it: chat_template.jinja and additional_chat_templates/, else
    tokenizer_config.json."""
    files = [path / "chat_template.jinja",
             *sorted(path.glob("additional_chat_templates/*.jinja"))]
    texts = [f.read_text(encoding="utf-8") for f in files if f.is_file()]
    template = _json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return "\n".join(texts) or template or None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
