"""`bench serve` as a Python entry: a frozen config in, one RunResult per concurrency out."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from server.bench.client import CHAT, ENDPOINTS, Sampling
from server.bench.metrics import SLO_METRICS
from server.bench.runner import RunResult, Target, TokenCounter, run_workload
from server.bench.workloads import (
    WORKLOADS,
    AgentSession,
    RequestSpec,
    TokenText,
    Workload,
    agent_sessions,
    code_edit_requests,
    random_requests,
    shared_prefix_requests,
    vision_requests,
)


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything one `bench serve` invocation runs. `input_len` is the unique part of each
    prompt: the whole prompt (random), the suffix (shared-prefix), the task (agents), the
    file and instruction (code-edit), the question (vision). `image_size`: the vision
    workload's pictures, (width, height)."""

    base_url: str
    workload: Workload = "random"
    endpoint: str = CHAT
    model: str | None = None
    # Several names: the independent requests spread over them in turn (LoRA adapters
    # beside their base); `model` is then the first.
    models: tuple[str, ...] = ()
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    max_concurrency: tuple[int | None, ...] = (None,)
    request_rate: float = math.inf
    num_groups: int = 4
    prompts_per_group: int = 4
    prefix_len: int = 512
    sessions: int = 4
    turns: int = 3
    tool_result_len: int = 128
    image_size: tuple[int, int] = (448, 448)
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    num_warmups: int = 1
    timeout_s: float = 600.0
    slos_ms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; use one of {WORKLOADS}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.workload in ("agents", "vision") and self.endpoint != CHAT:
            raise ValueError(f"the {self.workload} workload sends chat messages: use "
                             f"--endpoint {CHAT}")
        if len(self.models) > 1 and self.workload == "agents":
            raise ValueError("several --model names spread independent requests; an agents "
                             "session keeps one model: name one")
        if min(self.image_size) < 1:
            raise ValueError(f"--image-size must be at least 1x1, got {self.image_size}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not self.request_rate > 0:
            raise ValueError(
                f"--request-rate must be positive (inf: all at once), got {self.request_rate}"
            )
        counts = {
            "num_prompts": self.num_prompts,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "num_groups": self.num_groups,
            "prompts_per_group": self.prompts_per_group,
            "prefix_len": self.prefix_len,
            "sessions": self.sessions,
            "turns": self.turns,
            "tool_result_len": self.tool_result_len,
        }
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if any(c is not None and c < 1 for c in self.max_concurrency):
            raise ValueError(f"--max-concurrency values must be at least 1: {self.max_concurrency}")
        unknown = set(self.slos_ms) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"unknown goodput metrics {sorted(unknown)}; use {SLO_METRICS}")

    def to_json(self) -> dict:
        data = asdict(self)
        data["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return data


def build_workload(
    config: ServeBenchConfig, tokenizer: Any
) -> tuple[list[RequestSpec], list[AgentSession]]:
    """(independent requests, agent sessions): one of the two is empty; the requests each
    naming one of `config.models` in turn where it names several."""
    requests, sessions = _build_workload(config, tokenizer)
    if len(config.models) > 1:
        names = config.models
        requests = [replace(r, model=names[i % len(names)]) for i, r in enumerate(requests)]
    return requests, sessions


def _build_workload(
    config: ServeBenchConfig, tokenizer: Any
) -> tuple[list[RequestSpec], list[AgentSession]]:
    rng = random.Random(config.seed)
    text = TokenText(tokenizer, rng)
    if config.workload == "random":
        requests = random_requests(
            text, rng, config.num_prompts, config.input_len, config.output_len, config.range_ratio
        )
        return requests, []
    if config.workload == "shared-prefix":
        requests = shared_prefix_requests(
            text,
            config.num_groups,
            config.prompts_per_group,
            config.prefix_len,
            config.input_len,
            config.output_len,
        )
        return requests, []
    if config.workload == "code-edit":
        requests = code_edit_requests(
            text, rng, config.num_prompts, config.input_len, config.output_len
        )
        return requests, []
    if config.workload == "vision":
        requests = vision_requests(
            text, rng, config.num_prompts, config.image_size, config.input_len, config.output_len
        )
        return requests, []
    sessions = agent_sessions(
        text,
        rng,
        config.sessions,
        config.turns,
        config.prefix_len,
        config.input_len,
        config.tool_result_len,
        config.output_len,
    )
    return [], sessions


async def run_serve_bench(config: ServeBenchConfig, tokenizer: Any) -> list[RunResult]:
    """Run the workload once per `max_concurrency` value, in order, on the same prompts."""
    requests, sessions = build_workload(config, tokenizer)
    sampling = Sampling(
        model=config.model,
        temperature=config.temperature,
        ignore_eos=config.ignore_eos,
        # A fixed-length run should neither end early nor emit control tokens.
        eos_token_ids=tuple(tokenizer.all_special_ids),
    )
    target = Target(
        config.base_url.rstrip("/"),
        config.endpoint,
        sampling,
        config.timeout_s,
        config.num_warmups,
    )
    counter = TokenCounter(tokenizer)
    vision = config.workload == "vision"
    runs = []
    for index, concurrency in enumerate(config.max_concurrency):
        if vision and index:  # pictures of its own: the last run's are cached by now
            requests, _ = build_workload(replace(config, seed=config.seed + index), tokenizer)
        run = await run_workload(
            target,
            counter,
            requests=requests,
            sessions=sessions,
            max_concurrency=concurrency,
            request_rate=config.request_rate,
            slos_ms=config.slos_ms,
            seed=config.seed,
            warmup=_vision_warmup(config, tokenizer, index) if vision else None,
            measure_encoder=vision,
        )
        runs.append(run)
    return runs


def _vision_warmup(config: ServeBenchConfig, tokenizer: Any, index: int) -> RequestSpec:
    """A picture and question of the workload's size, drawn apart from every run's."""
    rng = random.Random(f"warm-up {config.seed} {index}")
    [spec] = vision_requests(TokenText(tokenizer, rng), rng, 1, config.image_size,
                             config.input_len, config.output_len)  # fmt: skip
    return spec


def load_tokenizer(path: Path | None) -> Any:
    """The tokenizer of a local model dir; by default the converted default model's."""
    from metal_engine.loading.tokenizer_loading import load_tokenizer as load_model_tokenizer

    if path is None:
        from convert import ensure_default_model

        path = ensure_default_model(progress=False)
    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer {path} is not a directory; pass a local model directory")
    return load_model_tokenizer(path)
