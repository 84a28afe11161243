"""Synthetic workloads: prompts of chosen token lengths, built from the model's own vocabulary.

random         independent requests, lengths spread uniformly around the targets
shared-prefix  groups of requests whose system prompt (the prefix) is identical
agents         sessions that resend a growing conversation: a shared system prompt with
               tool schemas, then per turn the assistant's answer and a tool result
code-edit      a pasted Python file to send back with one small change: the answer mostly
               repeats the prompt, the case where drafting n-grams from the prompt pays off
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

Workload = Literal["random", "shared-prefix", "agents", "code-edit"]
WORKLOADS: tuple[Workload, ...] = ("random", "shared-prefix", "agents", "code-edit")


@dataclass(frozen=True)
class RequestSpec:
    """One request: the conversation to send and how many tokens to ask for."""

    messages: tuple[dict[str, str], ...]
    output_len: int
    group: int | None = None

    def prompt(self) -> str:
        """The same content as one completions prompt."""
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
        special = set(tokenizer.all_special_ids)
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


# ---- code-edit: plausible Python files, built from templates --------------------------------

CODE_EDIT_SYSTEM = (
    "You are a coding assistant. When asked to change a file, reply with the complete "
    "updated file only, in one code block, with no commentary."
)
_VERBS = ("load", "save", "parse", "build", "fetch", "update", "merge", "validate", "compute")
_ADJECTIVES = ("pending", "active", "cached", "recent", "valid", "remote", "local", "expired")
_NOUNS = ("user", "order", "record", "session", "item", "request", "event", "job", "task",
          "message", "account", "invoice", "report", "node", "metric", "device")  # fmt: skip
_FIELDS = ("value", "score", "count", "size", "priority", "weight")


class Template(NamedTuple):
    code: str  # str.format fields: name, noun, nouns, adj, field, comment, number, small
    comments: tuple[str, ...]  # that fit the code; the edit may swap one for another


_FUNCTIONS = (
    Template(
        '''def {name}({nouns}: list[dict], limit: int = {number}) -> int:
    """Add up the {field} of the {adj} {nouns}, at most `limit` of them."""
    total = 0
    for index, {noun} in enumerate({nouns}):
        if index >= limit:
            break
        # {comment}
        total += {noun}.get("{field}", 0)
    return total
''',
        ("Entries without a {field} count as zero.", "Old exports leave the {field} out."),
    ),
    Template(
        '''def {name}({nouns}: list[dict], threshold: int = {number}) -> list[dict]:
    """The {adj} {nouns} whose {field} is above `threshold`, in their original order."""
    result = []
    for {noun} in {nouns}:
        # {comment}
        if {noun}["{field}"] > threshold:
            result.append({noun})
    return result
''',
        ("Strictly above: equal {field}s stay out.", "Callers rely on the order kept here."),
    ),
    Template(
        '''def {name}({nouns}: list[dict]) -> dict[str, dict]:
    """Map each {noun}'s {field} to the {noun}; later duplicates win."""
    index = {{}}
    for {noun} in {nouns}:
        # {comment}
        index[str({noun}["{field}"])] = {noun}
    return index
''',
        ("Keys are strings so the index survives a JSON round trip.", "Later {nouns} win."),
    ),
    Template(
        '''def {name}(path: str) -> dict:
    """Read the {adj} {nouns} from `path`; an empty dict when the file is missing."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        # {comment}
        return {{}}
''',
        ("A missing file means the defaults, not an error.", "First runs have no file yet."),
    ),
    Template(
        '''def {name}(client, retries: int = {small}) -> dict:
    """Get the {adj} {nouns} from the server, waiting longer after each failure."""
    attempt = 0
    while attempt < retries:
        response = client.get("/{nouns}/{adj}")
        if response.status_code == 200:
            return response.json()
        # {comment}
        attempt += 1
        time.sleep(0.5 * attempt)
    raise RuntimeError(f"{name} failed after {{retries}} attempts")
''',
        ("The server answers 503 while it restarts.", "Back off linearly; retries are few."),
    ),
)
_CLASS = Template(
    '''@dataclass
class {name}:
    """Keeps the {adj} {nouns} in memory, at most `capacity` of them."""

    capacity: int = {number}
    items: dict[str, dict] = field(default_factory=dict)

    def get(self, key: str) -> dict | None:
        return self.items.get(key)

    def put(self, key: str, {noun}: dict) -> None:
        if len(self.items) >= self.capacity:
            # {comment}
            oldest = next(iter(self.items))
            del self.items[oldest]
        self.items[key] = {noun}
''',
    ("Drop the oldest first; dicts keep insertion order.", "Full: make room for the new one."),
)


class Function(NamedTuple):
    name: str
    comment: str
    other_comment: str  # one that fits as well, for a "fix the comment" edit


@dataclass
class PythonModule:
    """A generated module, grown in place: constants after the imports, then blocks."""

    name: str
    header: str
    constants: list[str] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    functions: list[Function] = field(default_factory=list)  # the targets of an edit

    def text(self) -> str:
        parts = (self.header, "".join(self.constants), *self.blocks)
        return "\n\n".join(p for p in parts if p)


def code_edit_requests(
    text: TokenText, rng: random.Random, num_prompts: int, input_len: int, output_len: int
) -> list[RequestSpec]:
    """Each request: the shared system prompt, then a file and one change to make to it."""
    system = {"role": "system", "content": CODE_EDIT_SYSTEM}
    specs = []
    for _ in range(num_prompts):
        user = {"role": "user", "content": code_edit_prompt(text, rng, input_len)}
        specs.append(RequestSpec((system, user), output_len))
    return specs


def code_edit_prompt(text: TokenText, rng: random.Random, num_tokens: int) -> str:
    """A file and an instruction, about `num_tokens` long: whole functions and classes while
    they fit, then the instruction, then constants to fill (at least one function)."""
    noun, adj = rng.choice(_NOUNS), rng.choice(_ADJECTIVES)
    module = PythonModule(
        f"{adj}_{noun}s",
        f'"""Helpers for the {adj} {noun}s: loading, checking and indexing them."""\n\n'
        "from __future__ import annotations\n\n"
        "import json\nimport time\nfrom dataclasses import dataclass, field\n",
    )
    used: set[str] = set()
    # Parts are counted alone (linear time), the whole only twice: alone, a block's newlines
    # do not merge with the ones before it, so the sum overcounts a little until the recount.
    size = text.count(code_edit_message(module, _TYPICAL_INSTRUCTION))
    while True:
        block, function = _block(rng, used, is_first=not module.blocks)
        cost = text.count("\n\n" + block)
        if module.blocks and size + cost > num_tokens:
            break
        module.blocks.append(block)
        if function is not None:
            module.functions.append(function)
        size += cost
    instruction = edit_instruction(rng, module.functions)
    size = text.count(code_edit_message(module, instruction))
    while True:
        line = _constant(rng, used)
        cost = text.count(line)
        if size + cost > num_tokens:
            return code_edit_message(module, instruction)
        module.constants.append(line)
        size += cost


def code_edit_message(module: PythonModule, instruction: str) -> str:
    return f"Here is {module.name}.py:\n\n```python\n{module.text()}```\n\n{instruction}"


def edit_instruction(rng: random.Random, functions: list[Function]) -> str:
    """One small change to one of the functions: rename it, add a parameter, or a comment."""
    function = rng.choice(functions)
    kind = rng.choice(("rename", "parameter", "comment"))
    if kind == "rename":
        verb, rest = function.name.split("_", 1)
        new_verb = rng.choice([v for v in _VERBS if v != verb])
        new = _unique(f"{new_verb}_{rest}", {f.name for f in functions})
        return f"Rename the function `{function.name}` to `{new}`; change nothing else."
    if kind == "parameter":
        return (
            f"Add a keyword parameter `verbose: bool = False` to `{function.name}` and "
            "mention it in its docstring; change nothing else."
        )
    return (
        f"In `{function.name}`, the comment `# {function.comment}` is unclear: "
        f"replace it with `# {function.other_comment}`"
    )


_TYPICAL_INSTRUCTION = (
    "In `validate_expired_invoices`, the comment `# Keys are strings so the index survives "
    "a JSON round trip.` is unclear: replace it with `# Later invoices win.`"
)


def _block(rng: random.Random, used: set[str], is_first: bool) -> tuple[str, Function | None]:
    """A function, or now and then a class (not a target for edits)."""
    noun, adj = rng.choice(_NOUNS), rng.choice(_ADJECTIVES)
    # The first block is a function, so every file has one for the instruction to name.
    if not is_first and rng.random() < 0.2:
        suffix = rng.choice(("Cache", "Store", "Pool"))
        name = _unique(f"{adj.title()}{noun.title()}{suffix}", used)
        template = _CLASS
    else:
        name = _unique(f"{rng.choice(_VERBS)}_{adj}_{noun}s", used)
        template = rng.choice(_FUNCTIONS)
    fields = {"noun": noun, "nouns": f"{noun}s", "adj": adj, "field": rng.choice(_FIELDS)}
    comment, other = (c.format(**fields) for c in rng.sample(template.comments, 2))
    code = template.code.format(
        name=name,
        comment=comment,
        number=rng.choice((10, 32, 64, 100, 256, 1000)),
        small=rng.randint(2, 5),
        **fields,
    )
    return code, None if template is _CLASS else Function(name, comment, other)


def _constant(rng: random.Random, used: set[str]) -> str:
    kind, value = rng.choice((("LIMIT", 100), ("TIMEOUT_S", 30.0), ("BATCH_SIZE", 64)))
    name = _unique(f"{rng.choice(_ADJECTIVES)}_{rng.choice(_NOUNS)}_{kind}".upper(), used)
    return f"{name} = {value}\n"


def _unique(name: str, used: set[str]) -> str:
    """`name`, or `name_2`, `name_3`, ... when taken; the result is marked as used."""
    candidate, n = name, 1
    while candidate in used:
        n += 1
        candidate = f"{name}_{n}"
    used.add(candidate)
    return candidate
