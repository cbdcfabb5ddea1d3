"""Anthropic's Messages API request bodies, parsed and checked, and read as the chat request they are.

`MessagesRequest` (POST /v1/messages) and `CountTokensRequest` (POST /v1/messages/count_tokens) take
Anthropic's field names: `system` (a string or text blocks), `messages` of user, assistant (and system) turns
whose content is a string or `text`, `tool_use` and `tool_result` blocks, `max_tokens` (required, as
Anthropic requires it), `stop_sequences`, `temperature` (0 to 1), `top_p`, `top_k`, `tools` (name,
description, input_schema), `tool_choice` (auto, any, tool, none), `output_config.format` (a JSON schema
the answer follows), `stream` and `metadata`. A block type this gateway cannot read (an image, a
document) is refused naming the field, and so is a field the API does not have: nothing is ignored in
silence. `thinking` is accepted (a model that thinks answers with `thinking` blocks; the budget is not
enforced), and so are an earlier answer's `thinking` blocks, left out of the prompt. `cache_control`
is accepted and has no effect (the workers cache every prompt's prefix by themselves), and so is
`output_config.effort`. Strata's own `ignore_eos`, `priority`,
`allow_fallback` and `no_fallback` are taken as extra body fields, as the Chat Completions front door
takes them.

`as_chat` reads a request as the OpenAI Chat Completions request it is (openai_schema.py), so both front
doors share one mapping onto the pipeline (openai_mapping.py): a `tool_use` block becomes an assistant
turn's tool call, a `tool_result` block a `tool` turn answering it, `any` the `required` choice. This
module must not know the gRPC request nor send anything.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Body):
    """A call an earlier assistant turn made, as the client sends the conversation back."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None
    """These two as the SDK's ToolUseBlock echoes them back: accepted, unused (no server tools here)."""


class ToolResultBlock(_Body):
    """A user turn's answer to an earlier call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"error: {body}" if self.is_error else body


class ThinkingBlock(_Body):
    """An earlier answer's reasoning, as the client sends the conversation back: left out of the
    prompt, as chat templates leave out earlier turns' reasoning."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _blocks_in_their_turns(self) -> Message:
        for block in self.content if isinstance(self.content, list) else ():
            if isinstance(block, ThinkingBlock) and self.role != "assistant":
                raise ValueError("a thinking block belongs in an assistant turn")
            if self.role == "system" and not isinstance(block, TextBlock):
                raise ValueError("a system turn holds text blocks only")
            if isinstance(block, ToolUseBlock) and self.role != "assistant":
                raise ValueError("a tool_use block belongs in an assistant turn")
            if isinstance(block, ToolResultBlock) and self.role != "user":
                raise ValueError("a tool_result block belongs in a user turn")
        return self

    def turns(self) -> list[ChatMessage]:
        """The chat turns of this message: its tool results first (each a `tool` turn), then its text
        and calls as one turn of its role."""
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        results = [
            ChatMessage(role="tool", content=b.text(), tool_call_id=b.tool_use_id)
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        text = "\n".join(b.text for b in self.content if isinstance(b, TextBlock))
        calls = [
            AssistantToolCall(
                id=b.id, type="function", function=CalledFunction(name=b.name, arguments=json.dumps(b.input))
            )
            for b in self.content
            if isinstance(b, ToolUseBlock)
        ]
        if text or calls or not results:
            results.append(ChatMessage(role=self.role, content=text or None, tool_calls=calls or None))
        return results


class ToolDefinition(_Body):
    name: str
    description: str = ""
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    type: Literal["custom"] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None
    """True: at most one call in the answer."""

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: name is set exactly when type is 'tool'")
        return self


class Thinking(_Body):
    """Accepted either way: a model that thinks answers with `thinking` blocks, one that does not
    never does; `budget_tokens` is not enforced (max_tokens bounds the whole answer)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


ChatToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None
_CHOICES: dict[str, Literal["none", "auto", "required"]] = {"auto": "auto", "any": "required", "none": "none"}


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


class OutputConfig(_Body):
    format: OutputFormat | None = None
    """The answer follows this JSON schema (the structured output of structured-output.md)."""
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Accepted; a model here has one effort."""


class _Conversation(_Body):
    """What both endpoints read: the model, the conversation and its tools."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat_turns(self) -> list[ChatMessage]:
        turns = [turn for message in self.messages for turn in message.turns()]
        if self.system:
            text = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            turns.insert(0, ChatMessage(role="system", content=text))
        return turns

    def chat_tools(self) -> tuple[list[Tool] | None, ChatToolChoice]:
        tools = [
            Tool(
                type="function",
                function=FunctionDefinition(
                    name=tool.name, description=tool.description, parameters=tool.input_schema
                ),
            )
            for tool in self.tools or ()
        ]
        choice = self.tool_choice
        if choice is None:
            return tools or None, None
        if choice.type == "tool":
            named = NamedToolChoice(type="function", function=FunctionName(name=choice.name or ""))
            return tools or None, named
        return tools or None, _CHOICES[choice.type]


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """Anthropic's `user_id` and the like: accepted, and not used."""
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # Strata's own options, as extra body fields (as the Chat Completions front door takes them).
    ignore_eos: bool = False
    priority: Literal["interactive", "batch"] | None = None
    allow_fallback: bool = False
    no_fallback: bool = False

    def as_chat(self) -> ChatCompletionRequest:
        """The Chat Completions request this one is: the same turns, tools, limits and sampling."""
        tools, choice = self.chat_tools()
        output = self.output_config.format if self.output_config is not None else None
        schema = JsonSchemaFormat(name="output", schema=output.schema_) if output is not None else None
        return ChatCompletionRequest(
            model=self.model,
            messages=self.chat_turns(),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            stream=self.stream,
            ignore_eos=self.ignore_eos,
            priority=self.priority,
            allow_fallback=self.allow_fallback,
            no_fallback=self.no_fallback,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=False
            if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use
            else None,
            response_format=ResponseFormat(type="json_schema", json_schema=schema)
            if schema is not None
            else None,
        )


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: a conversation to count, nothing to generate."""

    def as_chat(self) -> ChatCompletionRequest:
        tools, choice = self.chat_tools()
        return ChatCompletionRequest(
            model=self.model, messages=self.chat_turns(), max_tokens=1, tools=tools, tool_choice=choice
        )
