"""Synthetic workloads: prompts of chosen token lengths, built from the model's own vocabulary.

random         independent requests, lengths spread uniformly around the targets
shared-prefix  groups of requests whose system prompt (the prefix) is identical
agents         sessions that resend a growing conversation: a shared system prompt with
               tool schemas, then per turn the assistant's answer and a tool result
code-edit      a pasted Python file to send back with one small change: the answer mostly
               repeats the prompt, the case where drafting n-grams from the prompt pays off
vision         a picture (a generated PNG of a chosen size) and a short question about it
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Literal

from server.bench.code_files import code_edit_prompt
from server.bench.pictures import picture_data_url

Workload = Literal["random", "shared-prefix", "agents", "code-edit", "vision"]
WORKLOADS: tuple[Workload, ...] = ("random", "shared-prefix", "agents", "code-edit", "vision")


@dataclass(frozen=True)
class RequestSpec:
    """One request: the conversation to send and how many tokens to ask for. A message's
    content is text, or chat content parts (text and images)."""

    messages: tuple[dict[str, Any], ...]
    output_len: int
    group: int | None = None
    model: str | None = None  # None: the run's model

    def prompt(self) -> str:
        """The same content as one completions prompt (text messages only)."""
        # A blank line keeps the prefix's tokens intact (BPE does not merge across it).
        return "\n\n".join(m["content"] for m in self.messages)


@dataclass(frozen=True)
class AgentSession:
    """A session's fixed parts; the assistant's answers come from the server at run time."""

    system: str
    task: str
    tool_results: tuple[str, ...]  # the one appended after each turn's answer
    output_len: int


class TokenText:
    """Text that the tokenizer encodes to a chosen number of tokens (usually exactly)."""

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self._tokenizer = tokenizer
        self._rng = rng
        special = special_ids(tokenizer)
        self._ids = [i for i in range(len(tokenizer)) if i not in special]

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def random(self, num_tokens: int) -> str:
        ids = self._sample(num_tokens)
        # Decoding and re-encoding can merge or split tokens: trim or top up, then retry.
        for _ in range(8):
            text = self._tokenizer.decode(ids)
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                break
            ids = ids[:num_tokens] + self._sample(num_tokens - len(ids))
        return text

    def _sample(self, n: int) -> list[int]:
        return [self._rng.choice(self._ids) for _ in range(max(n, 0))]


def special_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special tokens: those it names (eos, pad, ...) and every added token
    marked special (a model's image and tool markers may be listed nowhere else). Their
    text in a prompt would be read as plain characters, not as the token."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


def spread(target: int, range_ratio: float, rng: random.Random) -> int:
    """A length drawn uniformly from [target * (1 - r), target * (1 + r)], at least 1."""
    low = max(1, round(target * (1 - range_ratio)))
    high = max(low, round(target * (1 + range_ratio)))
    return rng.randint(low, high)


def random_requests(
    text: TokenText,
    rng: random.Random,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
) -> list[RequestSpec]:
    specs = []
    for _ in range(num_prompts):
        content = text.random(spread(input_len, range_ratio, rng))
        output = spread(output_len, range_ratio, rng)
        specs.append(RequestSpec(({"role": "user", "content": content},), output))
    return specs


def shared_prefix_requests(
    text: TokenText,
    num_groups: int,
    prompts_per_group: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
) -> list[RequestSpec]:
    """Groups in order; each request is (shared system prompt, unique user message)."""
    specs = []
    for group in range(num_groups):
        system = {"role": "system", "content": text.random(prefix_len)}
        specs += [
            RequestSpec(
                messages=(system, {"role": "user", "content": text.random(suffix_len)}),
                output_len=output_len,
                group=group,
            )
            for _ in range(prompts_per_group)
        ]
    return specs


def agent_sessions(
    text: TokenText,
    rng: random.Random,
    sessions: int,
    turns: int,
    system_len: int,
    task_len: int,
    tool_result_len: int,
    output_len: int,
) -> list[AgentSession]:
    system = agent_system_prompt(text, rng, system_len)
    return [
        AgentSession(
            system=system,
            task=text.random(task_len),
            tool_results=tuple(
                tool_result(text, rng, tool_result_len) for _ in range(max(turns - 1, 0))
            ),
            output_len=output_len,
        )
        for _ in range(sessions)
    ]


def agent_system_prompt(text: TokenText, rng: random.Random, num_tokens: int) -> str:
    """Instructions and synthetic JSON tool schemas, about `num_tokens` long (whole schemas)."""
    head = "You are an agent. Call one of these tools when it helps, then answer.\n\nTools:\n"
    tools: list[str] = []
    while text.count(head + "\n".join(tools)) < num_tokens:
        tools.append(json.dumps(_tool_schema(text, rng, len(tools))))
    return head + "\n".join(tools)


def tool_result(text: TokenText, rng: random.Random, num_tokens: int) -> str:
    # Sent as a user message: servers that validate `tool` messages want matching tool calls.
    return f"Tool result (call {rng.randrange(10**6)}): {text.random(num_tokens)}"


def _tool_schema(text: TokenText, rng: random.Random, index: int) -> dict:
    params = {
        f"arg_{i}": {
            "type": rng.choice(["string", "integer", "boolean"]),
            "description": text.random(8),
        }
        for i in range(rng.randint(1, 3))
    }
    return {
        "type": "function",
        "function": {
            "name": f"tool_{index}",
            "description": text.random(24),
            "parameters": {"type": "object", "properties": params, "required": sorted(params)},
        },
    }


# ---- code-edit: the file itself comes from code_files -------------------------------------------

CODE_EDIT_SYSTEM = (
    "You are a coding assistant. When asked to change a file, reply with the complete "
    "updated file only, in one code block, with no commentary."
)


def code_edit_requests(
    text: TokenText, rng: random.Random, num_prompts: int, input_len: int, output_len: int
) -> list[RequestSpec]:
    """Each request: the shared system prompt, then a file and one change to make to it."""
    system = {"role": "system", "content": CODE_EDIT_SYSTEM}
    specs = []
    for _ in range(num_prompts):
        user = {"role": "user", "content": code_edit_prompt(text.count, rng, input_len)}
        specs.append(RequestSpec((system, user), output_len))
    return specs



# ---- vision: one picture and a question per request ------------------------------------------


def vision_requests(
    text: TokenText,
    rng: random.Random,
    num_prompts: int,
    image_size: tuple[int, int],
    input_len: int,
    output_len: int,
) -> list[RequestSpec]:
    """Each request: a picture of its own (`image_size`, width x height, drawn from `rng`),
    then a question of `input_len` tokens about it."""
    specs = []
    for _ in range(num_prompts):
        image = {"type": "image_url", "image_url": {"url": picture_data_url(image_size, rng)}}
        question = {"type": "text", "text": text.random(input_len)}
        specs.append(RequestSpec(({"role": "user", "content": [image, question]},), output_len))
    return specs
