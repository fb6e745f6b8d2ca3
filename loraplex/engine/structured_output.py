"""Structured output: grammar-constrained decoding with xgrammar token bitmasks.

A request asks for it with ``SamplingParams.structured_outputs`` (a
:class:`StructuredOutputsParams`, named and shaped as vLLM's): exactly one of a
JSON schema, any JSON object, a regex, a choice among strings, or an EBNF
grammar. The engine then keeps one xgrammar ``GrammarMatcher`` per sequence:

- compile: :meth:`StructuredOutputManager.compile` turns the params into an
  xgrammar ``CompiledGrammar`` once per distinct constraint (an LRU cache keyed
  by the canonical constraint text); a bad schema/regex/grammar raises
  :class:`StructuredOutputError` naming the problem.
- one matcher per sequence (``n > 1`` completions each get their own), created
  at ``add_request``; it accepts each token the engine appends, so after a
  preemption (recompute or swap) it is still in step with the sequence's output
  tokens and needs no rebuild.
- masks: :class:`GrammarMaskFiller` fills the ``[B, ceil(V/32)] int32``
  bitmask of the rows sampled in a step on a worker thread, started before
  the step's forward pass, so the host-side mask work overlaps input
  preparation, kernel launches and the device's forward; the sampler waits for
  it only when the logits are ready and applies it on the logits' device
  (:func:`loraplex.engine.sampler.apply_token_bitmask_`). Unconstrained rows get
  all-ones rows (no change), so they sample exactly what they would alone.

Bit ``j % 32`` of word ``j // 32`` of a row is token ``j`` (1 = allowed), the
xgrammar layout. JSON is generated compact by default (``", "`` and ``": "``
separators, no free whitespace): free whitespace lets small models loop on
blanks; ``any_whitespace=True`` allows it.

xgrammar is imported lazily: the engine imports and serves unconstrained
requests without it; a constrained request without it raises
:class:`StructuredOutputError` (install the ``serve`` extra).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from loraplex.engine.structured_params import StructuredOutputError, StructuredOutputsParams

# xgrammar's own cache of compiled grammars (unbounded by default: ~1 MB for a schema of 40 properties)
XGRAMMAR_CACHE_LIMIT_BYTES = 256 * 2**20

BITS_PER_WORD = 32

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class GrammarState:
    """One sequence's matcher: which tokens may come next given its output so far."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_accepted_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar refuses it (nothing changes then)."""
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_accepted_tokens += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        """The matcher accepted a stop token (the constrained output is complete)."""
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and vocabulary, and makes matchers.

    ``vocab_size``: the model's logits width ``V`` (may exceed the tokenizer's
    size: ids past it are never allowed). ``stop_token_ids``: the ids that end a
    complete constrained output (the model's EOS ids). Thread-safe: the API
    compiles on its worker threads (to report a bad schema as 400 before the
    request is queued) and the engine thread compiles again (a cache hit).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *, max_cached_grammars: int = 256,
                 max_threads: int = 8, cache_limit_bytes: int = XGRAMMAR_CACHE_LIMIT_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached_grammars = max_cached_grammars
        self.max_threads = max_threads
        self.cache_limit_bytes = cache_limit_bytes
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def compile(self, params: StructuredOutputsParams):
        """The xgrammar ``CompiledGrammar`` of ``params`` (cached). Raises :class:`StructuredOutputError`."""
        key = params.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if params.kind == "json":
            keyword = unenforced_schema_keyword(params.json)
            if keyword is not None:
                raise StructuredOutputError(f"the JSON schema uses {keyword}, which loraplex's grammar engine "
                                            "(xgrammar) does not enforce; the output could break the schema")
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, params)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(f"{_what(params)} cannot be compiled: {_clean(exc)}") from None
        if not self._admits_a_token(compiled):
            raise StructuredOutputError(f"{_what(params)} admits no output: no token can start it")
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.max_cached_grammars:
                self._cache.popitem(last=False)
        return compiled

    def _admits_a_token(self, compiled) -> bool:
        """Whether a fresh matcher of ``compiled`` allows any first token (a stop token counts)."""
        xgr = _xgrammar()
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one sequence. Raises :class:`StructuredOutputError`."""
        xgr = _xgrammar()
        return GrammarState(xgr.GrammarMatcher(self.compile(params), override_stop_tokens=self.stop_token_ids))

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_limit_bytes=self.cache_limit_bytes)
            return self._compiler

    def _compile(self, compiler, params: StructuredOutputsParams):
        kind = params.kind
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(params.json), any_whitespace=params.any_whitespace,
                                                strict_mode=params.strict)
        if kind == "json_object":
            schema = {"type": "object"}
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=params.any_whitespace,
                                                strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_regex("|".join(re.escape(c) for c in params.choice))
        return compiler.compile_grammar(params.grammar)


class GrammarMaskFiller:
    """Fills the token bitmask of a step's sampled rows on one worker thread.

    :meth:`submit` returns at once; :meth:`PendingMask.result` gives the
    ``[B, ceil(V/32)] int32`` mask on the sampling device (``-1`` = all allowed
    on unconstrained rows), or None when no row is constrained. Counters for
    benchmarks: ``num_masks``, ``fill_s`` (worker time filling), ``wait_s``
    (time the engine thread waited for a mask: the part not overlapped).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = -(-vocab_size // BITS_PER_WORD)
        self._executor: ThreadPoolExecutor | None = None
        self._batch_matcher = None
        self.num_masks = 0
        self.fill_s = 0.0
        self.wait_s = 0.0

    def submit(self, states: list[GrammarState | None]) -> PendingMask | None:
        """Start filling the mask of rows ``states`` (None = unconstrained row)."""
        if all(s is None for s in states):
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.num_masks += 1
        return PendingMask(self._executor.submit(self._fill, states), self)

    def _fill(self, states: list[GrammarState | None]) -> torch.Tensor:
        start = time.perf_counter()
        xgr = _xgrammar()
        # Pinned on CUDA so the copy in PendingMask.result is asynchronous (the caching host
        # allocator does not hand the block out again before that copy has run).
        bitmask = torch.full((len(states), self.num_words), -1, dtype=torch.int32,
                             pin_memory=self.device.type == "cuda")
        rows = [i for i, s in enumerate(states) if s is not None and not s.is_terminated]
        if rows:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, rows)
        self.fill_s += time.perf_counter() - start
        return bitmask

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class PendingMask:
    """A mask being filled; :meth:`result` waits for it and moves it to the device."""

    def __init__(self, future: Future, filler: GrammarMaskFiller) -> None:
        self.future = future
        self.filler = filler

    def result(self) -> torch.Tensor:
        """``[B, ceil(V/32)] int32`` on the device."""
        start = time.perf_counter()
        mask = self.future.result()
        self.filler.wait_s += time.perf_counter() - start
        device = self.filler.device
        return mask if device.type == "cpu" else mask.to(device, non_blocking=True)


# JSON Schema keywords xgrammar (0.2.x) accepts but does not enforce (session 32's review: each let outputs break
# their schema): refused, never ignored. ``allOf`` is refused with more than one member.
_UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
                        "dependentSchemas", "dependencies", "propertyNames", "unevaluatedProperties",
                        "unevaluatedItems", "patternProperties")
# where subschemas sit: a keyword holding one schema, a list of them, or a name -> schema map
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def unenforced_schema_keyword(schema: Any) -> str | None:
    """The first construct of JSON schema ``schema`` that xgrammar would accept without enforcing (a keyword of
    ``_UNENFORCED_KEYWORDS``, ``allOf`` of several members, ``uniqueItems: true``, a ``required`` name not in
    ``properties``, an empty ``anyOf``/``oneOf``, a ``$ref`` outside the document), as text; None when there is
    none. Walks subschemas (``properties``, ``items``, ``anyOf`` ... ``$defs``) without recursion."""
    stack = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in _UNENFORCED_KEYWORDS:
            if key in node:
                return f"{key!r} at {where}"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of {len(node['allOf'])} schemas at {where}"
        if node.get("uniqueItems") is True:
            return f"'uniqueItems' at {where}"
        for key in ("anyOf", "oneOf"):
            if node.get(key) == []:
                return f"an empty {key!r} at {where}"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"the remote '$ref' {ref!r} at {where}"
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required")
        if isinstance(required, list):
            missing = [name for name in required if name not in properties]
            if missing:
                return f"'required' names not in 'properties' ({missing[:3]}) at {where}"
        for key in _ONE_SCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}/{key}"))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in node[key].items())
    return None


def _xgrammar():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise StructuredOutputError("structured outputs need the 'xgrammar' package "
                                    "(pip install 'loraplex[serve]')") from None
    return xgrammar


def _what(params: StructuredOutputsParams) -> str:
    return {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
            "choice": "the choice list", "grammar": "the EBNF grammar"}[params.kind]


def _clean(exc: BaseException) -> str:
    lines = [_XGR_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__
