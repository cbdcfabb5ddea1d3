"""A conversation with tools, as the chat template reads it: in the model's own format when its
template renders tools, in Strata's wording when it does not.

A template that reads the `tools` variable (Qwen2.5's, Llama 3.1's, Hermes', ...) was trained with
its own tool prompt: `conversation` hands it the tools (OpenAI's shape, `{"type": "function",
"function": {...}}`) and the turns as Hugging Face's `apply_chat_template` takes them (an assistant
turn's `tool_calls` with their arguments as objects, `tool` turns with their `tool_call_id`), so the
model sees what it saw in training. A template without tools (SmolLM2's) gets the tools described in
the system message, the calls the answer may make written `<tool_call>{...}</tool_call>` one a line
(the format the gateway's grammar enforces), earlier calls written the same way in the assistant's
turn and tool answers as user turns in `<tool_response>` tags. A request whose tool choice is NONE
shows no tools either way. This module must not tokenize nor know gRPC services.
"""

from __future__ import annotations

import json
from typing import Any

from strata.v1 import common_pb2, gateway_pb2

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
Mode = gateway_pb2.ToolChoiceMode


def _shows_tools(tools: list[gateway_pb2.Tool], choice: gateway_pb2.ToolChoice) -> bool:
    """Whether the model is shown the tools: some are given and the choice is not NONE."""
    return bool(tools) and choice.mode != Mode.TOOL_CHOICE_MODE_NONE


def conversation(
    messages: list[common_pb2.ChatMessage],
    tools: list[gateway_pb2.Tool],
    choice: gateway_pb2.ToolChoice,
    template_tools: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The turns and the tools (None: none shown) to render with a template that renders tools
    (`template_tools`) or not."""
    shown = _shows_tools(tools, choice)
    if template_tools:
        listed = [_function(tool) for tool in tools] if shown else None
        return [_structured(message) for message in messages], listed
    turns = [_written(message) for message in messages]
    if shown:
        _describe(turns, tools, choice)
    return turns, None


def _function(tool: gateway_pb2.Tool) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": _parameters(tool)},
    }


def _parameters(tool: gateway_pb2.Tool) -> Any:
    return json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object"}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # written back as the string the client holds


def _structured(message: common_pb2.ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments_json)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _written(message: common_pb2.ChatMessage) -> dict[str, Any]:
    """A turn as plain text: a tool's answer is a user turn, earlier calls the assistant's text."""
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>{message.content}</tool_response>"}
    if message.tool_calls:
        written = [
            CALL_OPEN + json.dumps({"name": c.name, "arguments": _arguments(c.arguments_json)}) + CALL_CLOSE
            for c in message.tool_calls
        ]
        return {"role": message.role, "content": "\n".join([message.content, *written]).strip()}
    return {"role": message.role, "content": message.content}


def _describe(
    turns: list[dict[str, Any]], tools: list[gateway_pb2.Tool], choice: gateway_pb2.ToolChoice
) -> None:
    """Put the tools in a system message (the first one, or a new one before the conversation)."""
    listing = "\n".join(
        json.dumps({"name": tool.name, "description": tool.description, "parameters": _parameters(tool)})
        for tool in tools
    )
    call = f'{CALL_OPEN}{{"name": <tool name>, "arguments": <arguments object>}}{CALL_CLOSE}'
    single = choice.mode == Mode.TOOL_CHOICE_MODE_NAMED or choice.single_call
    calls = f"{call}." if single else f"{call}, one line per call."
    if choice.mode in (Mode.TOOL_CHOICE_MODE_AUTO, Mode.TOOL_CHOICE_MODE_UNSPECIFIED):
        how = f"To call tools, answer with only {calls} Otherwise answer in plain text."
    else:
        how = f"Answer with only {calls}"
    text = f"You can call these tools:\n{listing}\n{how}"
    if turns and turns[0]["role"] == "system":
        turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{text}"}
    else:
        turns.insert(0, {"role": "system", "content": text})
