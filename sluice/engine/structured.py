"""Structured outputs: grammar-constrained decoding with llguidance (docs/structured_outputs.md).

    SamplingParams.structured --grammar_spec()--> llguidance grammar text
        --GrammarCompiler.submit()-->  compiled in a thread, once per (constraint, tokenizer), LRU cached
        --GrammarState (per request)-> a copy of the compiled matcher, advanced by every output token:
                                          accept(token) -> the tokens jump-forward appends
        --MaskBatch (per step)-------> the constrained rows' token masks, computed in a thread while the
                                       model runs; the sampler waits for them (SamplingRow.mask_bias)

One compiler per engine, and so per tokenizer: its cache key is the constraint alone.  llguidance
builds its lexer lazily and computes masks in Rust with the GIL released, so neither a compile nor a
step's masks hold up the step loop (NOTE(grammar-wait) in the scheduler, NOTE(mask-overlap) below).

Importing this module loads no torch: the API process may check a constraint with
``validate_constraint``, which builds the grammar exactly as the engine will.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.engine.protocol import (
    STRUCTURED_COMPILE_BUCKETS,
    STRUCTURED_MASK_BUCKETS,
    StructuredOutputs,
)
from sluice.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

__all__ = ["GrammarCompiler", "GrammarState", "MaskBatch", "grammar_spec", "constraint_key", "compile_grammar",
           "make_ll_tokenizer", "validate_constraint", "JSON_OPTIONS"]

log = logging.getLogger("sluice.engine")

# NOTE(json-whitespace): JSON is generated with fixed separators (", " and ": ", json.dumps' own) and no
# other whitespace.  With flexible whitespace nothing after a value is forced (a space or a newline may
# come first), so a schema's keys could not be jumped over, and a small model may pad an answer with
# newlines up to max_tokens.  Fixed separators make ``{"name": "`` one forced run (jump-forward).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARAM = "structured_outputs"  # what an engine-side grammar error names (the API maps it to its own field)


def constraint_key(so: StructuredOutputs) -> tuple[str, str]:
    """(kind, text): the cache key of a constraint; raises ``InvalidRequestError`` for a malformed one."""
    kind = so.kind()
    if kind == "json":
        text = so.json or ""
        try:
            json.loads(text)
        except ValueError as e:
            raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}", param=PARAM) from None
        return kind, text
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        if not so.choice or any(not isinstance(c, str) or not c for c in so.choice):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings", param=PARAM)
        return kind, json.dumps(so.choice)
    return kind, str(getattr(so, kind))


def grammar_spec(kind: str, text: str) -> str:
    """The llguidance grammar of a constraint (``constraint_key``'s pair); ``ValueError`` if it cannot be built."""
    from llguidance import LLMatcher, grammar_from

    if kind == "json":
        return LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "choice":
        return grammar_from("choice", text)
    if kind == "regex":
        return grammar_from("regex", text)
    return grammar_from("grammar", text)  # llguidance Lark (with %json), or GBNF


def validate_constraint(so: StructuredOutputs) -> None:
    """Raise ``InvalidRequestError`` (param ``structured_outputs``) for a constraint the engine would refuse:
    the same grammar text the engine compiles, checked by llguidance without a tokenizer (milliseconds)."""
    from llguidance import LLMatcher

    key = constraint_key(so)
    try:
        error = LLMatcher.validate_grammar(grammar_spec(*key))
    except ValueError as e:
        error = str(e)
    if error:
        raise InvalidRequestError(f"invalid structured output constraint: {error}", param=PARAM)


def make_ll_tokenizer(hf_tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int) -> Any:
    """llguidance's view of the tokenizer (~0.3 s for a 49k vocabulary): EOS is every id the engine stops on,
    and the vocabulary at least the model's (an lm_head padded past the tokenizer: those ids are never allowed)."""
    import llguidance.hf

    n_vocab = max(vocab_size, len(hf_tokenizer))
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=list(eos_token_ids))


@dataclass
class _Entry:
    """A compiled constraint: a matcher that is never advanced (requests take copies), or the error."""

    matcher: Any | None  # llguidance.LLMatcher
    error: str | None
    num_bytes: int
    seconds: float  # compile time


def _histogram(bounds: Sequence[float]) -> list[int]:
    return [0] * (len(bounds) + 1)


@dataclass
class StructuredCounters:
    """What ``EngineStats.structured_*`` report (cumulative)."""

    num_requests: int = 0
    num_compiles: int = 0
    num_compile_errors: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0
    compile_buckets: list[int] = field(default_factory=lambda: _histogram(STRUCTURED_COMPILE_BUCKETS))
    num_mask_steps: int = 0
    mask_seconds: float = 0.0
    mask_wait_seconds: float = 0.0
    mask_buckets: list[int] = field(default_factory=lambda: _histogram(STRUCTURED_MASK_BUCKETS))
    num_tokens: int = 0
    num_jump_forward_tokens: int = 0

    def observe_compile(self, seconds: float) -> None:
        self.num_compiles += 1
        self.compile_seconds += seconds
        self.compile_buckets[bisect.bisect_left(STRUCTURED_COMPILE_BUCKETS, seconds)] += 1

    def observe_masks(self, seconds: float, waited: float) -> None:
        self.num_mask_steps += 1
        self.mask_seconds += seconds
        self.mask_wait_seconds += waited
        self.mask_buckets[bisect.bisect_left(STRUCTURED_MASK_BUCKETS, seconds)] += 1


class GrammarCompiler:
    """Compiles constraints off the step loop and keeps them in an LRU bounded in entries and bytes.

    ``submit(key)`` starts a compile unless the key is cached or already compiling (then it is a
    cache hit); ``entry(key)`` is the result once there (None while compiling).  The tokenizer is
    built by the first job, as soon as the engine starts, so the first request rarely waits for it.
    ``compile_fn`` (kind, text, tokenizer) -> matcher is what a job runs: tests wrap it (a slow compile).

    NOTE(grammar-bytes): llguidance does not report a compiled grammar's memory; an entry counts
    ``GRAMMAR_BASE_BYTES`` plus ``GRAMMAR_BYTES_PER_CHAR`` per character of its llguidance grammar
    text.  Resident memory per compiled matcher (after its first mask; 200 of a kind, SmolLM2's
    tokenizer): 25 KB for a 354-character grammar, 26 KB for 940, 190 KB for 2,343 (a 60-key
    object); the estimate gives 39, 76 and 166 KB.  Lexer states llguidance adds while masking later
    are not counted.
    """

    def __init__(
        self,
        make_tokenizer: Callable[[], Any],
        *,
        max_entries: int = 512,
        max_bytes: int = 256 * 1024**2,
        num_threads: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self.counters = StructuredCounters()
        self.compile_fn: Callable[[str, str, Any], Any] = compile_grammar
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="sluice-grammar")
        self._tokenizer: Future[Any] = self._pool.submit(make_tokenizer)
        self._lock = threading.Lock()  # guards _cache and _jobs (jobs finish on the pool's threads)
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._jobs: dict[tuple[str, str], Future[_Entry]] = {}
        self._ready = threading.Condition(self._lock)
        self.num_bytes = 0
        self.overlap = True  # NOTE(mask-overlap); False: masks computed when the sampler asks (benchmarks' A/B)
        self._masks: tuple[ThreadPoolExecutor, Any] | None = None  # the mask thread and llguidance's executor

    @property
    def tokenizer(self) -> Any:
        """llguidance's tokenizer (blocks until it is built)."""
        return self._tokenizer.result()

    def submit(self, key: tuple[str, str]) -> None:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.counters.num_cache_hits += 1
                return
            if key in self._jobs:
                self.counters.num_cache_hits += 1
                return
            self._jobs[key] = self._pool.submit(self._run, key)

    def entry(self, key: tuple[str, str]) -> _Entry | None:
        with self._lock:
            e = self._cache.get(key)
            if e is not None:
                return e
            job = self._jobs.get(key)
        if job is None:  # evicted between submit and now: compile again
            self.submit(key)
            return None
        return job.result() if job.done() else None

    def has_jobs(self) -> bool:
        with self._lock:
            return bool(self._jobs)

    def wait_any(self, timeout: float) -> None:
        """Sleep until a compile finishes or ``timeout`` seconds pass (an engine with nothing else to do)."""
        with self._ready:
            if self._jobs:
                self._ready.wait(timeout)

    def _run(self, key: tuple[str, str]) -> _Entry:
        spec = ""
        error: str | None = None
        try:
            tokenizer = self.tokenizer  # built once, by the first job: not part of any compile's time
        except Exception as e:  # noqa: BLE001 -- every request then ends with this error instead of waiting
            tokenizer, error = None, f"the tokenizer could not be loaded for structured outputs: {e}"
        t0 = time.monotonic()
        try:
            if tokenizer is None:
                raise RuntimeError(error)
            spec = grammar_spec(*key)
            matcher = self.compile_fn(key[0], spec, tokenizer)
            error = str(matcher.get_error()) if matcher.is_error() else None
        except Exception as e:  # noqa: BLE001 -- a grammar the library refuses, whatever the exception
            matcher, error = None, str(e) or type(e).__name__
        seconds = time.monotonic() - t0
        if error:
            log.info("structured outputs: %s constraint refused after %.3fs: %s", key[0], seconds, error[:200])
        entry = _Entry(None if error else matcher, error, GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * len(spec), seconds)
        with self._ready:
            self.counters.observe_compile(seconds)
            self._jobs.pop(key, None)
            self._cache[key] = entry
            self.num_bytes += entry.num_bytes
            while len(self._cache) > 1 and (len(self._cache) > self.max_entries or self.num_bytes > self.max_bytes):
                _, old = self._cache.popitem(last=False)
                self.num_bytes -= old.num_bytes
            self._ready.notify_all()
        return entry

    @property
    def num_entries(self) -> int:
        return len(self._cache)

    def start_masks(self, states: list[GrammarState], vocab_size: int) -> MaskBatch:
        """Start computing a step's masks for these (ready) states, on a thread of their own: a mask
        never queues behind a compile."""
        if self._masks is None:
            from llguidance import LLExecutor

            self._masks = (ThreadPoolExecutor(1, thread_name_prefix="sluice-masks"), LLExecutor())
        pool, executor = self._masks
        num_words = (self.tokenizer.vocab_size + 31) // 32
        return MaskBatch(pool if self.overlap else None, executor, states, num_words, vocab_size, self.counters)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._masks is not None:
            self._masks[0].shutdown(wait=False)


GRAMMAR_BASE_BYTES = 16 * 1024  # NOTE(grammar-bytes)
GRAMMAR_BYTES_PER_CHAR = 64


def compile_grammar(kind: str, spec: str, tokenizer: Any) -> Any:
    from llguidance import LLMatcher

    del kind
    return LLMatcher(tokenizer, spec, log_level=0)


class GrammarState:
    """One request's place in its grammar: an llguidance matcher that has consumed its output tokens.

    ``matcher`` is None while the grammar compiles.  ``accept(token)`` consumes a sampled token and
    returns what jump-forward appends after it (NOTE(jump-forward)); ``forced()`` is the canonical
    forced run at the current state.  ``num_accepted`` counts the output tokens consumed: after a
    preemption the request keeps its tokens, and ``sync`` rebuilds the state from them if they differ.
    """

    def __init__(self, key: tuple[str, str], started: float, jump_forward: bool):
        self.key = key
        self.started = started  # when its compile was asked for (the compile timeout runs from here)
        self.jump_forward = jump_forward
        self.matcher: Any | None = None
        self.num_accepted = 0

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    def start(self, template: Any, output_token_ids: Sequence[int]) -> None:
        self.matcher = template.deep_copy()
        self.num_accepted = 0
        if output_token_ids:
            self.sync(output_token_ids)

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Rebuild the state from the request's output tokens (callers check ``num_accepted`` first)."""
        if self.matcher is None:
            return
        self.matcher.reset()
        self.matcher.consume_tokens(list(output_token_ids))
        self.num_accepted = len(output_token_ids)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, tokenized canonically by llguidance ([] when none)."""
        assert self.matcher is not None
        return list(self.matcher.compute_ff_tokens())

    def accept(self, token: int) -> bool:
        assert self.matcher is not None
        self.num_accepted += 1
        return bool(self.matcher.consume_token(token))

    def accept_forced(self, tokens: Sequence[int]) -> None:
        assert self.matcher is not None
        self.matcher.consume_tokens(list(tokens))
        self.num_accepted += len(tokens)

    @property
    def is_done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (or the matcher failed)."""
        return self.matcher is not None and bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher is not None and self.matcher.is_error() else None


class MaskBatch:
    """The token masks of one step's constrained rows, computed in a thread while the model runs.

    NOTE(mask-overlap): the masks depend only on the tokens accepted so far, which the step does not
    change until it is over, so they are computed while the forward pass runs; llguidance drops the GIL.
    On 2 CPU cores that the forward pass already fills it still pays a little (docs/structured_outputs.md
    has the A/B); on a GPU the CPU is idle.
    The sampler waits for them (``row(j)``): a (vocab,) float32 tensor to add to the logits, 0 where a
    token is allowed and -inf elsewhere (an add is ~10x cheaper than ``masked_fill_`` on the CPU).
    With jump-forward off, a row where the grammar forces a run allows only its first token, the
    token jump-forward would append (NOTE(jump-forward)).
    """

    def __init__(self, pool: ThreadPoolExecutor | None, executor: Any, states: list[GrammarState], num_words: int,
                 vocab_size: int, counters: StructuredCounters):  # fmt: skip
        self._counters = counters
        self._vocab_size = vocab_size
        self._args = (executor, states, num_words)
        self._future = None if pool is None else pool.submit(self._compute, *self._args)
        self._allowed: torch.Tensor | None = None

    def _compute(self, executor: Any, states: list[GrammarState], num_words: int) -> tuple[torch.Tensor, float]:
        import torch

        t0 = time.monotonic()
        bits = np.full((len(states), num_words), -1, dtype=np.int32)  # bit i of word w: token 32 * w + i
        executor.unsafe_compute_mask_ptr([(s.matcher, j) for j, s in enumerate(states)], bits.ctypes.data, num_words * 4, len(states))
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")  # (rows, words * 32) of 0 / 1
        # 0.0 where allowed, -inf elsewhere, as bit patterns: ~8x faster than a boolean-indexed fill
        bias = ((allowed ^ 1).astype(np.uint32) * np.uint32(0xFF800000)).view(np.float32)
        v = self._vocab_size
        if v <= bias.shape[1]:
            bias = bias[:, :v]
        else:  # an lm_head wider than llguidance's vocabulary: the ids past it are never allowed
            bias = np.concatenate([bias, np.full((len(states), v - bias.shape[1]), -np.inf, np.float32)], axis=1)
        for j, s in enumerate(states):
            if not s.jump_forward and (ff := s.forced()) and ff[0] < v:
                bias[j] = -np.inf
                bias[j, ff[0]] = 0.0
        return torch.from_numpy(bias), time.monotonic() - t0

    def row(self, j: int) -> torch.Tensor:
        if self._allowed is None:
            t0 = time.monotonic()
            self._allowed, seconds = self._compute(*self._args) if self._future is None else self._future.result()
            self._counters.observe_masks(seconds, time.monotonic() - t0)
        return self._allowed[j]
