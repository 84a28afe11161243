"""The chat request's tools, tool choice and response format, and the tool calls of its
assistant messages (chat_request.py), in the OpenAI chat API's shapes. Every API's tools
become these: their names and parameter schemas are what chat templates and tool parsers read."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.sampling_params import StructuredOutput
from server.http.errors import invalid_at
from server.http.unicode import ESCAPED_SURROGATE, escapes_lone_surrogate

MAX_TOOL_NAME_LENGTH = 64
# A tool's name on every API, as the chat API's function names: what chat templates and tool
# parsers expect. The dot lets the Responses API offer a namespace's members as "ns.name".
ToolName = Annotated[
    str, Field(min_length=1, max_length=MAX_TOOL_NAME_LENGTH, pattern=r"^[a-zA-Z0-9_.-]+$")
]


class FunctionDefinition(BaseModel):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        # A function without parameters takes an empty object.
        return self.parameters or {"type": "object", "properties": {}}


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: ToolName  # as a tool's: a longer one names no tool, and errors quote it


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the API sends it

    @field_validator("arguments")
    @classmethod
    def _valid_unicode(cls, arguments: str) -> str:
        if escapes_lone_surrogate(arguments):
            raise ValueError(ESCAPED_SURROGATE)
        return arguments

    def arguments_object(self) -> Any:
        """The arguments as a JSON value (chat templates expect objects, not JSON text)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class JSONSchemaFormat(BaseModel):
    # `schema` would shadow a BaseModel attribute, hence the alias.
    model_config = ConfigDict(populate_by_name=True)

    # OpenAI requires a name; vLLM and llama-server do without, and nothing here reads it.
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None  # required by type "json_schema"

    @model_validator(mode="after")
    def _schema_of_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            needs = 'type "json_schema" needs a "json_schema" object: {"schema": <a JSON schema>}'
            raise invalid_at((("json_schema",), needs))
        return self

    def structured(self) -> StructuredOutput | None:
        """What the sampler must enforce: nothing, any JSON object, or the given schema (with
        no schema, any JSON value).

        A schema is enforced whether or not `strict` is set: silently ignoring it would be worse.
        """
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema is None:
            return StructuredOutput()
        return StructuredOutput(json_schema=json.dumps(self.json_schema.schema_ or {}))
