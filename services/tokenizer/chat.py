"""Chat templates: compiling a model's Jinja template in a sandbox and rendering conversations with it.

Rendering follows Hugging Face's `apply_chat_template`: an immutable sandboxed Jinja environment with
trim_blocks and lstrip_blocks, the `raise_exception`, `strftime_now` and `tojson` helpers, the special
tokens as variables and `add_generation_prompt=True`, and the `tools` given (`renders_tools` says
whether the template reads them). Templates come from model folders, so they are untrusted code: the
sandbox is not optional. This module must not tokenize nor know about gRPC.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2 import meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.tokenizer.errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from jinja2.parser import Parser

ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"
"""A tool's answer: a role of its own for templates that render tools."""


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; it renders as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension declares it as a plain class attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt's text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may read."""

    def __init__(self, source: str, model: str, special_tokens: Mapping[str, str]) -> None:
        """Compile `source`; a syntax error is raised here, at load, rather than on the first request."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.model = model
        self._template = env.from_string(source)
        self._variables = dict(special_tokens)
        self.renders_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        """Whether the template reads the `tools` variable: the model has a tool format of its own."""

    def render(self, turns: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model's prompt text, ending with the assistant's generation prompt.

        `turns` are Hugging Face's message dicts (`role`, `content`, and for templates that render
        tools an assistant's `tool_calls` and a tool turn's `tool_call_id`); `tools` the functions in
        OpenAI's shape. A bad role, or a conversation the template itself refuses (say, roles that do
        not alternate), is an InvalidArgument naming the message.
        """
        roles = (*ROLES, TOOL_ROLE) if self.renders_tools else ROLES
        for index, turn in enumerate(turns):
            role = turn["role"]
            if not role:
                raise InvalidArgument(f"messages[{index}].role is empty; use one of {', '.join(roles)}")
            if role not in roles:
                raise InvalidArgument(
                    f"messages[{index}].role is {role!r}, which is not a known role; "
                    f"use one of {', '.join(roles)}"
                )
        try:
            return self._template.render(
                messages=[dict(turn) for turn in turns],
                tools=tools,
                documents=None,
                add_generation_prompt=True,
                **self._variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            # Templates refuse conversations they cannot express (raise_exception); that is the
            # client's input, not a server fault.
            raise InvalidArgument(
                f"messages: the chat template of model '{self.model}' refused the conversation: {exc}"
            ) from exc
