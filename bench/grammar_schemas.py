"""The JSON schemas the structured-output benchmarks rotate over, each with one document it accepts.

Five shapes an application asks of a model: flat records, enums, nested arrays of objects, bounded
numbers, a string pattern. Strings and arrays are bounded (maxLength, maxItems) so that a valid
document always fits the quality benchmark's 256 tokens. The sample documents let the mask-time
benchmark walk every matcher through a real output without a model. This module holds data only:
no timing, no library imports.
"""

from __future__ import annotations

import json
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 60},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "title": {"type": "string", "maxLength": 60},
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
            "in_stock": {"type": "boolean"},
        },
        "required": ["id", "title", "price", "tags", "in_stock"],
        "additionalProperties": False,
    },
    "address": {
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 50},
            "city": {"type": "string", "maxLength": 30},
            "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain", "USA"]},
        },
        "required": ["street", "city", "postcode", "country"],
        "additionalProperties": False,
    },
    "recipe": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "ingredients": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "item": {"type": "string", "maxLength": 20},
                        "grams": {"type": "integer", "minimum": 1, "maximum": 2000},
                    },
                    "required": ["item", "grams"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 4,
            },
            "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
        },
        "required": ["name", "ingredients", "minutes"],
        "additionalProperties": False,
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reason": {"type": "string", "maxLength": 80},
        },
        "required": ["label", "confidence", "reason"],
        "additionalProperties": False,
    },
}

SAMPLES: dict[str, dict[str, Any]] = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    "product": {
        "id": 7,
        "title": "Steel kettle",
        "price": 24.5,
        "tags": ["kitchen", "steel"],
        "in_stock": True,
    },
    "address": {"street": "10 Rue de Rivoli", "city": "Paris", "postcode": "75001", "country": "France"},
    "recipe": {
        "name": "Pancakes",
        "ingredients": [{"item": "flour", "grams": 200}, {"item": "milk", "grams": 300}],
        "minutes": 20,
    },
    "sentiment": {"label": "positive", "confidence": 0.9, "reason": "The customer loved the service."},
}

# What the quality benchmark asks the model for, per schema; {topic} varies over 20 topics.
PROMPTS: dict[str, str] = {
    "person": "Describe a fictional person who works as a {topic}, as JSON with name, age and email.",
    "product": "Invent a shop product related to {topic}, as JSON with id, title, price, tags and in_stock.",
    "address": "Give the address of a {topic} shop in Europe as JSON: street, city, postcode, country.",
    "recipe": "Write a short recipe that a {topic} would like, as JSON with name, ingredients and minutes.",
    "sentiment": "Classify the sentiment of this review: 'The {topic} was late and rude.' Answer as JSON.",
}

TOPICS = (
    "baker",
    "pilot",
    "teacher",
    "gardener",
    "doctor",
    "musician",
    "chef",
    "painter",
    "farmer",
    "engineer",
    "librarian",
    "tailor",
    "sailor",
    "nurse",
    "plumber",
    "writer",
    "florist",
    "cyclist",
    "barista",
    "carpenter",
)


def sample_text(name: str) -> str:
    """The sample document of schema `name`, with the separators the worker's JSON grammars use."""
    return json.dumps(SAMPLES[name], separators=(", ", ": "))
