"""Ten JSON schemas of the kinds apps send (objects, enums, arrays, nesting, optional fields, anyOf, patterns),
with one valid instance each: shared by the structured-output tests and benchmarks/structured_outputs.py."""
from __future__ import annotations

SCHEMAS: dict[str, tuple[dict, dict]] = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"], "additionalProperties": False},
               {"name": "Ada", "age": 36}),
    "sentiment": ({"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                                    "score": {"type": "number"}},
                   "required": ["label", "score"], "additionalProperties": False},
                  {"label": "positive", "score": 0.9}),
    "todo_list": ({"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"task": {"type": "string"}, "done": {"type": "boolean"}},
        "required": ["task", "done"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}},
        "required": ["items"], "additionalProperties": False},
        {"items": [{"task": "buy milk", "done": False}, {"task": "call Bob", "done": True}]}),
    "address": ({"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["FR", "DE", "US"]}},
        "required": ["street", "city", "zip", "country"], "additionalProperties": False},
        {"street": "1 rue de Rivoli", "city": "Paris", "zip": "75001", "country": "FR"}),
    "tags": ({"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
             ["llm", "serving"]),
    "weather_call": ({"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["location", "unit"], "additionalProperties": False},
        {"location": "Paris", "unit": "celsius", "days": 3}),
    "product": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "title": {"type": "string"}, "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}, "dimensions": {"type": "object", "properties": {
            "w": {"type": "number"}, "h": {"type": "number"}}, "required": ["w", "h"], "additionalProperties": False}},
        "required": ["id", "title", "price", "in_stock", "dimensions"], "additionalProperties": False},
        {"id": 7, "title": "lamp", "price": 19.5, "in_stock": True, "dimensions": {"w": 10, "h": 30}}),
    "answer_or_error": ({"anyOf": [
        {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
         "additionalProperties": False},
        {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"],
         "additionalProperties": False}]},
        {"answer": "42"}),
    "matrix": ({"type": "object", "properties": {"rows": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "items": {"type": "integer"}, "maxItems": 3}}}, "required": ["rows"],
        "additionalProperties": False},
        {"rows": [[1, 2], [3, 4]]}),
    "event": ({"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 40},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "priority": {"type": ["integer", "null"]}},
        "required": ["title", "date", "attendees", "priority"], "additionalProperties": False},
        {"title": "standup", "date": "2026-11-23", "attendees": ["a", "b"], "priority": None}),
}
