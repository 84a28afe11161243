"""The fake Python file of the `code-edit` workload: a plausible module built from templates,
sized to a token budget, and one small change to ask for on it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

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


def code_edit_prompt(count: Callable[[str], int], rng: random.Random, num_tokens: int) -> str:
    """A file and an instruction, about `num_tokens` long as `count` (text -> tokens) measures:
    whole functions and classes while they fit, then the instruction, then constants to fill
    (at least one function)."""
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
    size = count(code_edit_message(module, _TYPICAL_INSTRUCTION))
    while True:
        block, function = _block(rng, used, is_first=not module.blocks)
        cost = count("\n\n" + block)
        if module.blocks and size + cost > num_tokens:
            break
        module.blocks.append(block)
        if function is not None:
            module.functions.append(function)
        size += cost
    instruction = edit_instruction(rng, module.functions)
    size = count(code_edit_message(module, instruction))
    while True:
        line = _constant(rng, used)
        cost = count(line)
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
