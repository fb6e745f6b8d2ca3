"""Evaluating a tenant's adapters against the base model on a small evaluation set.

An evaluation set is JSONL (UTF-8, one JSON object per line, blank lines skipped), all
lines of one kind:

- multiple choice ``{"prompt": str, "choices": [str, ...], "answer": int | str}``
  (``answer``: the 0-based index of the right choice, or its text). Each choice is scored
  by the log-likelihood of its tokens given the prompt; the prediction is the choice with
  the highest one (ties: the first), as lm-evaluation-harness' ``acc``.
- generation ``{"prompt": str, "reference": str}``: greedy decoding (at most
  ``Settings.eval_max_new_tokens`` tokens, stopping at a newline) is correct when it equals
  the reference after normalization (lower case, punctuation dropped, whitespace collapsed);
  the reference's log-likelihood given the prompt is scored too.

Token ids: ``context = encode(prompt)`` (with the tokenizer's special tokens, as the engine
encodes a text prompt), ``continuation = encode(choice or reference)`` without special
tokens; the model sees ``context + continuation`` and the continuation's log-likelihood is
``sum_i log p(continuation[i] | context, continuation[:i])`` (natural log), read from the
engine's prompt logprobs (``SamplingParams(prompt_logprobs=0, max_tokens=1)``; the engine
computes them without the prefix cache, so every position is scored).

Priority: the engine has no per-request priority yet, so all evaluations of the process
together keep at most ``Settings.eval_max_concurrent_requests`` engine requests in flight
(default 2, ``PlatformContext.evaluation_limit``): tenants' traffic always finds the rest
of the batch, and a second run waits for the first one's requests. Evaluation requests are not charged to the
tenant's usage or rate limits.

Each run stores one :class:`~loraplex.platform.models.AdapterEvaluation` row per adapter
version (with the base model's scores of the same run), readable per tenant through
:func:`list_evaluations`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import string
import uuid
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.engine.input_processor import InvalidRequestError
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform import crud
from loraplex.platform.context import PlatformContext
from loraplex.platform.db import session_scope
from loraplex.platform.errors import Conflict, InvalidRequest, PayloadTooLarge, ServiceUnavailable
from loraplex.platform.models import AdapterEvaluation
from loraplex.platform.schemas import AdapterRoute, EvaluationPublic, TenantContext
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services import input_errors
from loraplex.platform.settings import Settings

Task = Literal["multiple_choice", "generation"]
MULTIPLE_CHOICE: Task = "multiple_choice"
GENERATION: Task = "generation"
_MC_KEYS = {"prompt", "choices", "answer"}
_GEN_KEYS = {"prompt", "reference"}
_PUNCTUATION = str.maketrans("", "", string.punctuation)
EVAL_SET_NAME_MAX = 128


# -- the evaluation set ----------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalItem:
    """One item: ``choices`` + ``answer`` (index) for multiple choice, ``reference`` for generation."""

    prompt: str
    choices: tuple[str, ...] = ()
    answer: int | None = None
    reference: str | None = None

    @property
    def expected(self) -> str:
        """The right answer's text."""
        return self.choices[self.answer] if self.answer is not None else (self.reference or "")


@dataclass(frozen=True)
class EvalSet:
    """A parsed evaluation set; ``sha256`` is the hex digest of the uploaded bytes."""

    name: str
    sha256: str
    task: Task
    items: tuple[EvalItem, ...]


def _bad(line: int, message: str) -> InvalidRequest:
    return InvalidRequest(f"evaluation set line {line}: {message}", param="file", code="invalid_eval_set")


def parse_eval_set(data: bytes, *, name: str, settings: Settings) -> EvalSet:
    """Parse and check an uploaded JSONL evaluation set (see the module docstring).

    Raises ``PayloadTooLarge`` (413) above ``settings.eval_max_file_bytes``, and
    ``InvalidRequest`` (400: ``param="name"`` for an empty name or one over 128 characters;
    otherwise ``code="invalid_eval_set"``, the message names the line) for
    bad UTF-8 or JSON, unknown or missing fields, mixed kinds, an answer that is not one of
    the choices, more than ``eval_max_items`` items or ``eval_max_choices`` choices, or no item.
    """
    name = name.strip()
    if not name or len(name) > EVAL_SET_NAME_MAX:
        raise InvalidRequest(f"name={name!r}: the evaluation set's name must be 1-{EVAL_SET_NAME_MAX} characters",
                             param="name")
    if len(data) > settings.eval_max_file_bytes:
        raise PayloadTooLarge(f"the evaluation set is larger than eval_max_file_bytes="
                              f"{settings.eval_max_file_bytes} bytes", param="file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the evaluation set is not UTF-8 text ({exc.reason} at byte {exc.start})",
                             param="file", code="invalid_eval_set") from None
    items: list[EvalItem] = []
    task: Task | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(items) == settings.eval_max_items:
            raise _bad(number, f"more than eval_max_items={settings.eval_max_items} items")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad(number, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        item, kind = _parse_item(number, obj, settings)
        if task is not None and kind != task:
            raise _bad(number, f"a {kind} item after {task} items: one evaluation set holds one kind")
        task = kind
        items.append(item)
    if not items:
        raise InvalidRequest("the evaluation set holds no item", param="file", code="invalid_eval_set")
    return EvalSet(name=name, sha256=hashlib.sha256(data).hexdigest(), task=task, items=tuple(items))


def _parse_item(number: int, obj: object, settings: Settings) -> tuple[EvalItem, Task]:
    if not isinstance(obj, dict):
        raise _bad(number, f"expected a JSON object, got {type(obj).__name__}")
    keys = set(obj)
    kind: Task = MULTIPLE_CHOICE if "choices" in keys else GENERATION
    expected = _MC_KEYS if kind == MULTIPLE_CHOICE else _GEN_KEYS
    if keys != expected:
        missing, unknown = sorted(expected - keys), sorted(keys - expected)
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise _bad(number, f"{', '.join(parts)} field(s): an item is {{prompt, choices, answer}} or "
                           "{prompt, reference}")
    prompt = obj["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise _bad(number, "'prompt' must be a non-empty string")
    if kind == GENERATION:
        reference = obj["reference"]
        if not isinstance(reference, str) or not reference.strip():
            raise _bad(number, "'reference' must be a non-empty string")
        return EvalItem(prompt=prompt, reference=reference), kind
    choices = obj["choices"]
    if (not isinstance(choices, list) or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)):
        raise _bad(number, "'choices' must be a list of at least 2 non-empty strings")
    if len(choices) > settings.eval_max_choices:
        raise _bad(number, f"{len(choices)} choices: more than eval_max_choices={settings.eval_max_choices}")
    answer = obj["answer"]
    if isinstance(answer, str):
        if answer not in choices:
            raise _bad(number, f"answer={answer!r} is not one of the choices")
        answer = choices.index(answer)
    elif not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise _bad(number, f"answer={answer!r} must be a choice's text or its index in 0..{len(choices) - 1}")
    return EvalItem(prompt=prompt, choices=tuple(choices), answer=answer), kind


def normalize_answer(text: str) -> str:
    """Lower case, ASCII punctuation dropped, whitespace runs collapsed, stripped."""
    return " ".join(text.lower().translate(_PUNCTUATION).split())


# -- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ItemScore:
    """One item on one model: ``loglik`` of the right answer / reference (nats, summed over its
    tokens), ``choice_logliks`` (multiple choice: one per choice), ``output`` (the predicted
    choice's text or the generated text) and whether it is ``correct``."""

    loglik: float
    correct: bool
    output: str
    choice_logliks: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelScore:
    """One model's scores; ``adapter`` None = the base model. ``accuracy`` = correct / items."""

    model: str
    adapter: str | None
    version: int | None
    adapter_version_id: int | None
    items: tuple[ItemScore, ...]

    @property
    def num_correct(self) -> int:
        return sum(s.correct for s in self.items)

    @property
    def accuracy(self) -> float:
        return self.num_correct / len(self.items)

    @property
    def mean_loglik(self) -> float:
        return sum(s.loglik for s in self.items) / len(self.items)


@dataclass(frozen=True)
class EvaluationReport:
    """A finished run: the base model first, then each adapter, all over the same items."""

    run_id: str
    eval_set: EvalSet
    base: ModelScore
    adapters: tuple[ModelScore, ...]

    @property
    def models(self) -> tuple[ModelScore, ...]:
        return (self.base, *self.adapters)

    def examples(self, count: int) -> list[dict]:
        """The first ``count`` items: ``{"prompt", "expected", "outputs": {model: output}}``."""
        return [{"prompt": item.prompt, "expected": item.expected,
                 "outputs": {m.model: m.items[i].output for m in self.models}}
                for i, item in enumerate(self.eval_set.items[:count])]


# -- running ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Target:
    label: str
    route: AdapterRoute | None
    lora: LoRARequest | None


async def run_evaluation(*, ctx: PlatformContext, tenant: TenantContext, adapter_names: list[str],
                         eval_set: EvalSet) -> EvaluationReport:
    """Score the base model and each of ``tenant``'s adapters ``adapter_names`` (their live
    versions) on ``eval_set``, store one row per adapter version, and return the report.

    Raises ``InvalidRequest`` (no adapter chosen, an item longer than the context),
    ``ModelNotFound`` (404: unknown adapter or another tenant's, same body),
    ``ServiceUnavailable`` (no engine running, or an adapter failed to load),
    ``Conflict`` (an adapter was deleted while the run was going on).
    """
    names = list(dict.fromkeys(adapter_names))
    if not names:
        raise InvalidRequest("choose at least one adapter to evaluate against the base model", param="adapters")
    engine = ctx.engine
    if engine is None or not engine.is_running or ctx.model_id is None:
        raise ServiceUnavailable("no model is being served: nothing to evaluate")
    routes = await asyncio.to_thread(
        lambda: [adapter_service.resolve_adapter(ctx=ctx, tenant_id=tenant.tenant_id, name=n) for n in names])
    targets = [_Target(ctx.model_id, None, None)]
    targets += [_Target(r.name, r, adapter_service.lora_request(r)) for r in routes]
    encoded = await asyncio.to_thread(_encode, ctx, eval_set)
    run_id = uuid.uuid4().hex
    scorer = _Scorer(ctx, run_id, ctx.evaluation_limit.semaphore())
    scores = await asyncio.gather(*(scorer.score_model(i, t, eval_set, encoded) for i, t in enumerate(targets)))
    report = EvaluationReport(run_id=run_id, eval_set=eval_set, base=scores[0], adapters=tuple(scores[1:]))
    await asyncio.to_thread(_store, ctx, tenant, report)
    return report


@dataclass(frozen=True)
class _EncodedItem:
    context: list[int]
    continuations: tuple[list[int], ...]  # one per choice, or the reference's alone


def _encode(ctx: PlatformContext, eval_set: EvalSet) -> list[_EncodedItem]:
    tokenizer = ctx.engine.tokenizer
    max_len = ctx.max_model_len
    encoded = []
    for number, item in enumerate(eval_set.items, start=1):
        context = tokenizer.encode(item.prompt, add_special_tokens=True)
        texts = item.choices if eval_set.task == MULTIPLE_CHOICE else (item.reference,)
        continuations = tuple(tokenizer.encode(t, add_special_tokens=False) for t in texts)
        longest = len(context) + max(len(c) for c in continuations)
        if eval_set.task == GENERATION:
            longest = max(longest, len(context) + ctx.settings.eval_max_new_tokens)
        if max_len is not None and longest >= max_len:
            raise InvalidRequest(f"evaluation item {number}: {longest} tokens, the model's context is "
                                 f"{max_len} tokens", param="file", code="context_length_exceeded")
        if any(not c for c in continuations):
            raise InvalidRequest(f"evaluation item {number}: a choice or reference encodes to no token",
                                 param="file", code="invalid_eval_set")
        encoded.append(_EncodedItem(context, continuations))
    return encoded


class _Scorer:
    """Runs one evaluation's engine requests, at most ``limit`` of them at a time."""

    def __init__(self, ctx: PlatformContext, run_id: str, limit: asyncio.Semaphore) -> None:
        self.ctx = ctx
        self.run_id = run_id
        self.limit = limit

    async def score_model(self, index: int, target: _Target, eval_set: EvalSet,
                          encoded: list[_EncodedItem]) -> ModelScore:
        items = await asyncio.gather(*(self._score_item(f"{index}-{i}", target, item, enc, eval_set.task)
                                       for i, (item, enc) in enumerate(zip(eval_set.items, encoded))))
        route = target.route
        return ModelScore(model=target.label, adapter=route.name if route else None,
                          version=route.version if route else None,
                          adapter_version_id=route.lora_int_id if route else None, items=tuple(items))

    async def _score_item(self, key: str, target: _Target, item: EvalItem, enc: _EncodedItem,
                          task: Task) -> ItemScore:
        logliks = await asyncio.gather(*(self.continuation_loglik(f"{key}-{j}", target.lora, enc.context, c)
                                         for j, c in enumerate(enc.continuations)))
        if task == MULTIPLE_CHOICE:
            best = max(range(len(logliks)), key=lambda j: (logliks[j], -j))
            return ItemScore(loglik=logliks[item.answer], correct=best == item.answer, output=item.choices[best],
                             choice_logliks=tuple(logliks))
        text = await self.greedy(f"{key}-gen", target.lora, enc.context)
        return ItemScore(loglik=logliks[0], correct=normalize_answer(text) == normalize_answer(item.reference),
                         output=text)

    async def continuation_loglik(self, key: str, lora: LoRARequest | None, context: list[int],
                                  continuation: list[int]) -> float:
        """``sum log p(continuation[i] | context + continuation[:i])`` from the engine's prompt logprobs."""
        token_ids = context + continuation
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        output = await self._run(key, token_ids, params, lora)
        plp = output.prompt_logprobs
        return sum(plp[pos][token_ids[pos]] for pos in range(len(context), len(token_ids)))

    async def greedy(self, key: str, lora: LoRARequest | None, context: list[int]) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=self.ctx.settings.eval_max_new_tokens, stop=["\n"])
        output = await self._run(key, context, params, lora)
        return output.outputs[0].text

    async def _run(self, key: str, token_ids: list[int], params: SamplingParams, lora: LoRARequest | None):
        request_id = f"eval-{self.run_id}-{key}"
        async with self.limit:
            final = None
            try:
                async for output in self.ctx.engine.generate(request_id, token_ids, params, lora):
                    final = output
            except InvalidRequestError as exc:
                raise input_errors.request_error(exc, prompt_param="file") from None
        if final is None or final.error:
            raise ServiceUnavailable(f"evaluation request on {lora.lora_name if lora else 'the base model'} "
                                     f"failed: {final.error if final else 'no output'}")
        return final


# -- stored results --------------------------------------------------------------------------------
def _store(ctx: PlatformContext, tenant: TenantContext, report: EvaluationReport) -> None:
    count = ctx.settings.eval_num_examples
    base = report.base
    rows = []
    for score in report.adapters:
        examples = [{"prompt": item.prompt, "expected": item.expected, "base": base.items[i].output,
                     "adapter": score.items[i].output}
                    for i, item in enumerate(report.eval_set.items[:count])]
        rows.append(AdapterEvaluation(
            tenant_id=tenant.tenant_id, adapter_version_id=score.adapter_version_id, run_id=report.run_id,
            eval_set_name=report.eval_set.name, eval_set_sha256=report.eval_set.sha256, task=report.eval_set.task,
            num_items=len(report.eval_set.items), accuracy=score.accuracy, mean_loglik=score.mean_loglik,
            base_model=base.model, base_accuracy=base.accuracy, base_mean_loglik=base.mean_loglik,
            examples=examples))
    with session_scope(ctx.sessions) as session:
        try:
            crud.add_evaluations(session=session, rows=rows)
            session.flush()
        except IntegrityError:
            raise Conflict("an evaluated adapter was deleted during the evaluation: nothing stored",
                           param="adapters") from None


def list_evaluations(*, session: Session, tenant_id: int | None, adapter_name: str | None = None,
                     ) -> list[EvaluationPublic]:
    """Stored evaluations, newest first: of one tenant (``tenant_id``), or of every tenant
    (``None``, the admin's view); ``adapter_name`` keeps one adapter's (all its versions)."""
    return [EvaluationPublic(
        run_id=e.run_id, tenant=t.name, adapter=a.name, version=v.version, version_id=v.content_hash,
        eval_set_name=e.eval_set_name, eval_set_sha256=e.eval_set_sha256, task=e.task, num_items=e.num_items,
        accuracy=e.accuracy, mean_loglik=e.mean_loglik, base_model=e.base_model, base_accuracy=e.base_accuracy,
        base_mean_loglik=e.base_mean_loglik, examples=list(e.examples), created_at=e.created_at)
        for e, t, a, v in crud.list_evaluations(session=session, tenant_id=tenant_id, adapter_name=adapter_name)]


__all__ = ["EvalItem", "EvalSet", "EvaluationReport", "ItemScore", "ModelScore", "list_evaluations",
           "normalize_answer", "parse_eval_set", "run_evaluation"]
