"""OpenAI's Responses API request body (POST /v1/responses), parsed and checked, and read as the chat
request it is.

`ResponsesRequest` takes the API's field names: `input` (a string, or a list of items: messages whose
content is a string or `input_text` / `output_text` parts, `function_call` items an earlier answer made
and `function_call_output` items answering them, and reasoning items, which are left out),
`instructions`, `max_output_tokens`, `temperature`,
`top_p`, `tools` (function tools), `tool_choice`, `text.format` (text, json_object, json_schema),
`truncation` (auto drops the conversation's oldest tokens, as Strata's `left` does), `stream`,
`store`, `previous_response_id` and `metadata`. A part this gateway cannot read (an image, a file), a
tool that is not a function, `background`, `conversation` and a field the API does not have are
refused naming the field: nothing is ignored in silence. `reasoning`, `prompt_cache_key`,
`safety_identifier` and `user` are accepted and have no effect (a model here has one effort; the
workers cache every prompt's prefix by themselves); `parallel_tool_calls: false` allows one call.
Strata's own `top_k`, `seed`, `ignore_eos`, `priority`, `allow_fallback` and `no_fallback` are
extra body fields, as the Chat Completions front door takes them.

`input_turns` reads the input as chat turns (a message a turn; calls join the assistant turn before
them; an output a `tool` turn); `as_chat` makes the Chat Completions request (openai_schema.py) of the
stored conversation a `previous_response_id` names, then the input, with `instructions` first, so
every front door shares one mapping onto the pipeline (openai_mapping.py). This module must not know
the gRPC request, the store, nor send anything.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from gateway.openai_schema import (
    AssistantToolCall,
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)

_TRUNCATIONS: dict[str, Literal["refuse", "left"]] = {"auto": "left", "disabled": "refuse"}
INCLUDABLE = frozenset({"reasoning.encrypted_content"})
"""`include` values accepted (there is no reasoning here to include); any other is refused."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    """Text of an earlier answer, as the client sends `response.output` back."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


Part = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(_Body):
    """A call an earlier answer made."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Body):
    """The client's answer to an earlier call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


class ReasoningItem(_Body):
    """An earlier answer's reasoning, as the client sends `response.output` back: left out of the
    prompt, as chat templates leave out earlier turns' reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str:
    """An item without `type` is a message (the API's "easy input message")."""
    found = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return str(found)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted; the arguments always follow the schema."""


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """text.format: plain text, any JSON object, or a named JSON schema."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("text.format: a json_schema format needs its name and schema")
        return self

    def response_format(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        schema = JsonSchemaFormat(name=self.name or "output", schema=self.schema_, strict=self.strict)
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted; a model here has one verbosity."""


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: str = ""
    """Empty (or absent) takes the gateway's default model."""
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = 1.0
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    service_tier: Literal["auto", "default"] | None = None
    background: bool = False
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Strata's own options, as extra body fields (as the Chat Completions front door takes them).
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    priority: Literal["interactive", "batch"] | None = None
    allow_fallback: bool = False
    no_fallback: bool = False

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background: true is not supported (answers are streamed instead); omit it")
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise ValueError(f"include: {value!r} is not supported; omit it")
        if self.metadata is not None and len(self.metadata) > 16:
            raise ValueError(f"metadata: {len(self.metadata)} keys, at most 16 allowed")
        return self

    def input_turns(self) -> list[ChatMessage]:
        """The input as chat turns, instructions excluded (they are not carried to a later response)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        turns: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                turns.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, ReasoningItem):
                continue
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
            else:
                call = AssistantToolCall(
                    id=item.call_id,
                    type="function",
                    function=CalledFunction(name=item.name, arguments=item.arguments),
                )
                last = turns[-1] if turns else None
                if last is not None and last.role == "assistant":
                    turns[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or ()), call]})
                else:
                    turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        return turns

    def as_chat(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The Chat Completions request of `history` (the stored conversation of
        previous_response_id), then the input, under the instructions."""
        messages = [*history, *self.input_turns()]
        if self.instructions:
            messages.insert(0, ChatMessage(role="system", content=self.instructions))
        text_format = self.text.format if self.text is not None else None
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stream=self.stream,
            ignore_eos=self.ignore_eos,
            priority=self.priority,
            allow_fallback=self.allow_fallback,
            no_fallback=self.no_fallback,
            truncation=_TRUNCATIONS[self.truncation] if self.truncation else None,
            tools=[
                Tool(
                    type="function",
                    function=FunctionDefinition(
                        name=tool.name, description=tool.description or "", parameters=tool.parameters
                    ),
                )
                for tool in self.tools
            ]
            if self.tools
            else None,
            parallel_tool_calls=self.parallel_tool_calls,
            tool_choice=NamedToolChoice(type="function", function=FunctionName(name=self.tool_choice.name))
            if isinstance(self.tool_choice, FunctionChoice)
            else self.tool_choice,
            response_format=text_format.response_format() if text_format is not None else None,
        )
