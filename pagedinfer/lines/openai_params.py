"""OpenAI request-body fields -> `SamplingParams` fields, one small function per field.

Each takes the field's JSON value and returns the `SamplingParams` keyword arguments it stands for
(possibly none), or raises ValueError whose message starts with the field's name; a batch line's
reader prefixes ``body.``. The values themselves are checked again by `SamplingParams`.
"""

from __future__ import annotations

from pagedinfer.sampling_params import StructuredOutputsParams, is_int

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def openai_response_format(value: object) -> dict:
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}`` -> ``structured_outputs`` (strict or not, the
    output follows the schema)."""
    if not isinstance(value, dict):
        raise ValueError("response_format must be an object with a 'type'")
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(
            f"response_format.type must be {', '.join(map(repr, RESPONSE_FORMATS))}, not {kind!r}"
        )
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise ValueError(
            f"response_format of type {kind!r} has unknown fields {', '.join(map(repr, extra or ['json_schema']))}"
        )
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"structured_outputs": StructuredOutputsParams(json_object=True)}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ValueError("response_format.json_schema must be an object with a 'schema' object")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ValueError(f"response_format.json_schema has unknown fields {', '.join(map(repr, unknown))}")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise ValueError("response_format.json_schema.strict must be true or false")
    schema = spec.get("schema", {})  # OpenAI: no schema is any JSON
    return {"structured_outputs": StructuredOutputsParams(json=schema or {"type": "object"})}


def openai_echo(value: object, logprobs: object) -> dict:
    """Completions ``echo`` with ``logprobs`` -> ``prompt_logprobs`` (the prompt's tokens get logprobs
    too, the first one null, as OpenAI's completions report them)."""
    if not isinstance(value, bool):
        raise ValueError("echo must be true or false")
    if value and is_int(logprobs):
        return {"prompt_logprobs": logprobs}
    return {}
