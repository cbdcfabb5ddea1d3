"""What the structured-output tests share: a bounded JSON schema, a tool's arguments schema, a regex, a
Lark grammar with the language it accepts, and a schema that takes long to compile (for the time bound).
"""

from __future__ import annotations

import json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
"""A weather tool's arguments: what the tool-call tests ask the model for."""
REGEX = "[0-9]{3}-[a-z]{2,4}"
LARK = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9][0-9]?/'
LARK_LANGUAGE = "yes|no|maybe [1-9][0-9]?"


def slow_schema(properties: int) -> str:
    return json.dumps(
        {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 9}}}[0-9]{{2,5}}$"}
                for i in range(properties)
            },
            "required": [f"field_{i}" for i in range(properties)],
        }
    )
