"""API side of structured output: request fields -> ``StructuredOutputsParams``, compiled
before the request is queued so a bad schema/regex/grammar is a 400 naming the problem.

Accepted (chat and completions):

- OpenAI ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object),
  ``json_schema`` (``json_schema.schema``; ``strict: true`` also refuses properties the schema
  does not name, as OpenAI's strict mode).
- vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"json_object": true}``,
  ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": EBNF}``.

At most one of the two (and none with a forced tool call). vLLM's retired ``guided_*``
top-level fields are refused, never ignored. The engine needs ``ignore_eos`` off and
``min_tokens`` 0 with a constraint (400 otherwise).
"""

from __future__ import annotations

import dataclasses

from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.structured_output import StructuredOutputError, StructuredOutputsParams
from loraplex.platform.errors import InvalidRequest

_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                  "guided_whitespace_pattern")


def requested_constraint(body) -> tuple[StructuredOutputsParams | None, str | None]:
    """(constraint, request field it came from) of a completion/chat request body, or (None, None).

    Raises ``InvalidRequest`` (400) for a refused or malformed field.
    """
    for name in _GUIDED_FIELDS:
        if getattr(body, name, None) is not None:
            raise InvalidRequest(f"{name} is not supported: use structured_outputs (vLLM's current field: "
                                 "{\"json\"|\"regex\"|\"choice\"|\"grammar\"|\"json_object\": ...}) or "
                                 "response_format", param=name, code="unsupported_parameter")
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise InvalidRequest("response_format and structured_outputs cannot both be given", param="structured_outputs")
    try:
        if so is not None:
            return _from_structured_outputs(so), "structured_outputs"
        if fmt is None or fmt.type == "text":
            if fmt is not None and fmt.json_schema is not None:
                raise ValueError("json_schema is only allowed with type 'json_schema'")
            return None, None
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise ValueError("json_schema is only allowed with type 'json_schema'")
            return StructuredOutputsParams(json_object=True), "response_format"
        if fmt.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        spec = fmt.json_schema
        return StructuredOutputsParams(json=spec.schema_, strict=bool(spec.strict)), "response_format"
    except ValueError as exc:
        field = "structured_outputs" if so is not None else "response_format"
        raise InvalidRequest(f"{field}: {str(exc).removeprefix('StructuredOutputsParams')}", param=field) from None


def _from_structured_outputs(so) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                   json_object=bool(so.json_object), any_whitespace=so.any_whitespace)


def compile_or_400(engine, constraint: StructuredOutputsParams, param: str) -> None:
    """Compile ``constraint`` with the engine's grammar compiler (cached for the engine thread).

    Raises ``InvalidRequest`` (400) naming the problem.
    """
    try:
        engine.structured_outputs.compile(constraint)
    except StructuredOutputError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param, code="invalid_schema") from None


def with_constraint(params: SamplingParams, constraint: StructuredOutputsParams | None, param: str) -> SamplingParams:
    """``params`` with ``structured_outputs`` set; 400 when the other fields do not allow it."""
    if constraint is None:
        return params
    try:
        return dataclasses.replace(params, structured_outputs=constraint)
    except ValueError as exc:
        message = str(exc)
        name = message.split("=", 1)[0].removeprefix("SamplingParams.") if message.startswith("Sampling") else param
        raise InvalidRequest(f"{message} (asked for by {param})", param=name) from None


def constrain(engine, params: SamplingParams, constraint: StructuredOutputsParams | None,
              param: str | None) -> SamplingParams:
    """Validate, compile and attach ``constraint`` (None: ``params`` unchanged). Raises 400s."""
    if constraint is None:
        return params
    params = with_constraint(params, constraint, param)
    compile_or_400(engine, constraint, param)
    return params


def chat_constraint(body, tools) -> tuple[StructuredOutputsParams | None, str | None]:
    """:func:`requested_constraint` of a chat request, or the grammar of its forced tool call
    (``tools``: a :class:`~loraplex.platform.services.tool_calls.ToolPlan` or None). Raises 400s."""
    constraint, param = requested_constraint(body)
    forced = tools.constraint() if tools is not None else None
    if forced is None:
        return constraint, param
    if constraint is not None:
        raise InvalidRequest(f"{param} cannot be combined with tool_choice={body.tool_choice!r} (a forced tool call "
                             "is constrained by the tool's parameters schema)", param=param)
    return forced, "tool_choice"
