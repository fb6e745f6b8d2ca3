"""JSON schema constructs that xgrammar accepts but does not enforce are found (and refused by
``StructuredOutputManager.compile``); the ones it enforces pass. xgrammar's compile cache is bounded."""

from __future__ import annotations

import pytest

from loraplex.engine.structured_output import unenforced_schema_keyword

ENFORCED = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "null"}]},
     "minItems": 1},
    {"$defs": {"P": {"type": "object", "properties": {"x": {"$ref": "#/$defs/P"}}}}, "$ref": "#/$defs/P"},
    {"allOf": [{"type": "string"}]},
    # a property *named* like a keyword is no keyword
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}},
     "required": ["not", "if"]},
]
UNENFORCED = [
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}, "'not' at #/properties/a"),
    ({"items": [{"type": "integer", "uniqueItems": True}]}, "'uniqueItems' at #/items/0"),
    ({"type": "object", "required": ["b"], "properties": {"a": {}}}, "'required' names not in 'properties'"),
    ({"allOf": [{"type": "object"}, {"required": []}]}, "'allOf' of 2 schemas"),
    ({"$defs": {"D": {"contains": {"const": 1}}}}, "'contains' at #/$defs/D"),
    ({"anyOf": []}, "an empty 'anyOf'"),
    ({"$ref": "https://example.com/s.json"}, "remote '$ref'"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties'"),
    ({"if": {}, "then": {}}, "'if'"),
]


@pytest.mark.parametrize("schema", ENFORCED)
def test_schemas_xgrammar_enforces_pass(schema):
    assert unenforced_schema_keyword(schema) is None


@pytest.mark.parametrize("schema, found", UNENFORCED)
def test_constructs_xgrammar_ignores_are_found(schema, found):
    assert found in unenforced_schema_keyword(schema)


def test_a_deep_schema_is_walked_without_recursion():
    schema: dict = {"type": "integer", "not": {}}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    assert unenforced_schema_keyword(schema).startswith("'not' at #/properties/a/properties/a")


def test_xgrammar_cache_is_bounded(tiny_llama_dir):
    from transformers import AutoTokenizer

    from loraplex.engine.structured_output import StructuredOutputManager
    from loraplex.engine.structured_params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    limit = 64 * 1024
    manager = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_limit_bytes=limit)
    for i in range(40):
        schema = {"type": "object", "properties": {f"f{i}_{j}": {"type": "integer"} for j in range(10)}}
        manager.compile(StructuredOutputsParams(json=schema))
    assert 0 < manager._compiler.get_cache_size_bytes() <= 2 * limit  # xgrammar evicts after an insert
    unbounded = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_limit_bytes=-1)
    for i in range(40):
        schema = {"type": "object", "properties": {f"f{i}_{j}": {"type": "integer"} for j in range(10)}}
        unbounded.compile(StructuredOutputsParams(json=schema))
    assert unbounded._compiler.get_cache_size_bytes() > 4 * limit  # the limit is what bounds it
