"""Messages that cross the engine boundary (torch-free, msgspec-encodable).

The API process sends ``EngineRequest`` / ``EngineAbort`` to the engine core and
receives ``EngineCoreOutputs`` (a batch of ``EngineOutput`` plus an
``EngineStats`` snapshot).  The offline ``LLM`` uses the same types in-process.

``EngineCoreProtocol`` is what drives an engine core: the engine core process
and ``LLM`` call it; ``EngineCore`` and the tests' ``FakeEngineCore``
implement it (mypy checks both against it).

Times are ``time.monotonic()`` seconds (CLOCK_MONOTONIC is shared by all
processes of one machine, so arrival stamps from the API process are
comparable with the engine's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from sluice.errors import InvalidRequestError, SluiceError, from_parts

if TYPE_CHECKING:
    from sluice.engine.config import ModelInfo

__all__ = [
    "STEP_KINDS",
    "STRUCTURED_COMPILE_BUCKETS",
    "STRUCTURED_MASK_BUCKETS",
    "StructuredOutputs",
    "SamplingParams",
    "EngineRequest",
    "EngineAbort",
    "RequestTimings",
    "TokenLogprobs",
    "EngineOutput",
    "EngineStats",
    "KVTierStats",
    "EngineCoreOutputs",
    "EngineControl",
    "EngineControlReply",
    "LoRAStats",
    "LoRALoadRecord",
    "EngineError",
    "FinishReason",
    "EngineCoreProtocol",
]


class FinishReason:
    STOP = "stop"  # EOS, a stop token id, or (API layer) a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # aborted by the client / server


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on a completion's tokens (vLLM's ``structured_outputs`` names); exactly one is set.

    The engine compiles it with llguidance once per (constraint, tokenizer), off the step
    loop, and masks each sampled token with it (docs/structured_outputs.md).
    """

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # llguidance Lark syntax (may embed ``%json {schema}``); GBNF-like EBNF

    def kind(self) -> str:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise InvalidRequestError(
                f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got {set_ or 'none'}",
                param="structured_outputs",
            )
        return set_[0]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one completion.  ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, > 1 discourages repeats
    frequency_penalty: float = 0.0  # OpenAI style, -2..2
    presence_penalty: float = 0.0  # OpenAI style, -2..2
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)  # applied on text (API / LLM)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token + top-k alternatives
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None  # None: unconstrained

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        if self.n < 1:
            raise bad("n", f"must be >= 1, got {self.n}")
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0) or self.repetition_penalty > 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {v}")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise bad("seed", "must fit in 64 bits")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")
        if self.structured is not None:
            self.structured.kind()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class EngineRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 1  # sluice.types.Priority value: 0 (P0, most urgent) .. 2
    arrival_time: float = 0.0  # monotonic seconds; 0 -> stamped on arrival at the engine
    trace_id: str | None = None  # W3C trace id (32 hex), for logs / spans
    ttft_target: float = 0.0  # seconds after arrival_time its first token is due (its class's SLO); 0: none
    lora_name: str | None = None  # a LoRA adapter the engine serves; None: the base model
    # W3C traceparent of the request's span: the parent of what the engine reports
    # for it after the fact (an adapter load it caused, ``LoRALoadRecord``)
    traceparent: str | None = None


class EngineAbort(msgspec.Struct, kw_only=True):
    request_ids: list[str]


class RequestTimings(msgspec.Struct, kw_only=True):
    arrival: float  # monotonic seconds
    grammar_ready: float | None = None  # a constrained request: its grammar compiled (or came from the cache)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class TokenLogprobs(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


class EngineError(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A ``SluiceError`` as it crosses the process boundary; ``to_exception`` rebuilds it."""

    type: str  # SluiceError.error_type
    message: str
    code: str | None = None
    param: str | None = None
    retry_after: float | None = None  # seconds, for 429 / 503

    @classmethod
    def from_exception(cls, e: SluiceError) -> EngineError:
        return cls(type=e.error_type, message=e.message, code=e.code, param=e.param,
                   retry_after=getattr(e, "retry_after", None))  # fmt: skip

    def to_exception(self) -> SluiceError:
        return from_parts(self.type, self.message, code=self.code, param=self.param, retry_after=self.retry_after)


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    finished: bool = False
    finish_reason: str | None = None  # FinishReason.*
    stop_token_id: int | None = None  # the token that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0  # total so far
    num_preemptions: int = 0
    timings: RequestTimings | None = None  # set when finished (and on the first token)
    error: EngineError | None = None  # engine-side rejection (e.g. prompt too long)


class KVTierStats(msgspec.Struct, kw_only=True):
    """One tier below the in-memory KV cache (today: 'disk'); counters are cumulative."""

    name: str
    is_enabled: bool = True  # False: turned off by a failing device
    is_writable: bool = True  # False: the device is full; still read
    num_blocks: int = 0  # blocks held now
    num_bytes: int = 0  # bytes held now (files incl. headers)
    capacity_bytes: int = 0
    hit_blocks: int = 0  # prompt blocks taken from this tier at admission
    hit_tokens: int = 0
    num_request_loads: int = 0  # requests that waited for loads
    load_seconds: float = 0.0  # sum over those requests of the wait (admission -> blocks in memory)
    recent_load_seconds: list[float] = msgspec.field(default_factory=list)  # waits since the previous snapshot
    num_load_failures: int = 0  # requests that fell back to recompute (a block missing or corrupt)
    num_loaded_blocks: int = 0
    num_block_reads: int = 0  # physical reads (shared loads read a block once)
    load_bytes: int = 0
    num_stored_blocks: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0  # writer busy time
    num_dropped_blocks: int = 0  # stores not taken (writer behind, tier off, already held)
    num_evicted_blocks: int = 0  # removed by the size cap
    num_corrupt: int = 0  # files or blocks found truncated, corrupt or foreign, and removed


STRUCTURED_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STRUCTURED_MASK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
STEP_KINDS = ("normal", "express", "nested")  # a step's kind: EngineStats.*_by_kind index them in this order


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    num_running_by_priority: list[int] = msgspec.field(default_factory=lambda: [0, 0, 0])
    num_waiting_by_priority: list[int] = msgspec.field(default_factory=lambda: [0, 0, 0])
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests, 0..1
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found cached
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # cumulative
    step_time: float = 0.0  # seconds, last step
    num_batched_tokens: int = 0  # last step
    num_batched_tokens_total: int = 0  # cumulative: every step's, nested express steps' too (NOTE(work-rate) in admission)
    # cumulative, by STEP_KINDS (NOTE(step-kinds) in core): the engine's seconds in steps of that kind (a normal
    # step's without the express steps nested in it), their batched tokens, and how many ran
    busy_seconds_by_kind: list[float] = msgspec.field(default_factory=lambda: [0.0, 0.0, 0.0])
    batched_tokens_by_kind: list[int] = msgspec.field(default_factory=lambda: [0, 0, 0])
    steps_by_kind: list[int] = msgspec.field(default_factory=lambda: [0, 0, 0])
    # cumulative: the kernels' work pool's waits for chunks other threads held, and those of 0.5 ms or more
    # (NOTE(pool-waits) in sluice/kernels/csrc/work_pool.h); 0 while the pool is off
    pool_wait_seconds: float = 0.0
    pool_stalls: int = 0
    pool_stall_seconds: float = 0.0
    num_decoding: int = 0  # running requests past their prefill (one token a step each)
    num_decoding_by_priority: list[int] = msgspec.field(default_factory=lambda: [0, 0, 0])
    # tokens still to prefill (waiting requests, chunked prefills; a preempted request's recompute), by class
    num_prefill_tokens_by_priority: list[int] = msgspec.field(default_factory=lambda: [0, 0, 0])
    step_time_base: float = 0.0  # seconds: fitted fixed cost of a step (a in a + b * batched tokens + c * seqs)
    step_time_per_token: float = 0.0  # seconds per batched token (b); both 0 until measured
    step_time_per_seq: float = 0.0  # seconds per scheduled sequence (c in a + b * tokens + c * seqs; 0: not separable)
    max_num_batched_tokens: int = 0  # a normal step's token budget (bounded under tight targets; 0: unknown)
    express_budget: int = 0  # tokens of P0 prefill an express step may batch (0: no express steps)
    express_mid_step: bool = False  # an express step may start mid-step: P0 does not wait for the running one
    max_num_seqs: int = 0  # the engine's running-sequences limit (0: unknown)
    # running requests each class may be admitted up to (slots kept for higher classes' recent peak left out)
    seq_limit_by_priority: list[int] = msgspec.field(default_factory=lambda: [0, 0, 0])
    # per request holding a slot (running or loading): [class, output tokens so far, output tokens it may still make]
    running_slots: list[list[int]] = msgspec.field(default_factory=list)
    lora: LoRAStats | None = None  # None: the engine serves no adapters
    kv_cache_dtype: str = ""  # fp32 | bf16 | fp16 | fp8 | int8
    kv_cache_bytes: int = 0  # memory of the in-memory KV cache
    num_cached_blocks: int = 0  # blocks of the in-memory cache that hold a prefix (a key)
    num_loading: int = 0  # requests waiting for KV blocks from a tier
    kv_tiers: list[KVTierStats] = msgspec.field(default_factory=list)
    # structured outputs (docs/structured_outputs.md); counters cumulative.  The histograms are counts per
    # bucket of STRUCTURED_COMPILE_BUCKETS / STRUCTURED_MASK_BUCKETS (seconds), the last past the last bound,
    # so the lanes of one server add up (their sums and counts too)
    structured_requests: int = 0  # constrained requests added
    structured_waiting_for_compile: int = 0  # requests waiting for their grammar now
    structured_compiles: int = 0  # grammars compiled (cache misses), failed ones too
    structured_compile_errors: int = 0  # requests ended by a grammar error or a compile timeout
    structured_cache_hits: int = 0  # constrained requests whose grammar was cached (or being compiled)
    structured_compile_seconds: float = 0.0  # sum of compile times
    structured_compile_buckets: list[int] = msgspec.field(default_factory=list)
    structured_cache_entries: int = 0  # grammars held now
    structured_cache_bytes: int = 0  # their estimated size (NOTE(grammar-bytes) in sluice.engine.structured)
    structured_mask_steps: int = 0  # steps that computed token masks
    structured_mask_seconds: float = 0.0  # sum of those steps' mask time (computed while the model ran)
    structured_mask_wait_seconds: float = 0.0  # ... of it the sampler waited for (not hidden by the forward)
    structured_mask_buckets: list[int] = msgspec.field(default_factory=list)  # per step
    structured_tokens: int = 0  # output tokens of constrained requests (sampled and jump-forward)
    jump_forward_tokens: int = 0  # of them appended by jump-forward, without a decode step each
    # speculative decoding (docs/speculative.md); counters cumulative, '' / zeros while it is off
    spec_method: str = ""  # the proposer: 'ngram' or 'draft_model'
    spec_drafted_tokens: int = 0  # draft tokens the target verified
    spec_accepted_tokens: int = 0  # ... of them kept (acceptance rate: accepted / drafted)
    spec_emitted_tokens: int = 0  # tokens emitted by the verifying rows (kept drafts + the target's own token)
    spec_verify_runs: int = 0  # (request, step) pairs that verified drafts (mean accepted length: accepted / runs)
    spec_k_counts: list[int] = msgspec.field(default_factory=list)  # [k]: times the policy chose k drafts for a request


class EngineCoreOutputs(msgspec.Struct, kw_only=True):
    outputs: list[EngineOutput]
    stats: EngineStats | None = None
    timestamp: float = 0.0
    lora_loads: list[LoRALoadRecord] = msgspec.field(default_factory=list)  # finished since the last message


class LoRAStats(msgspec.Struct, kw_only=True):
    """The engine's LoRA adapters (``EngineStats.lora``); counters are cumulative."""

    max_loras: int = 0  # adapters one step may hold
    adapters: list[str] = msgspec.field(default_factory=list)  # registered: requests may name them
    loaded: list[str] = msgspec.field(default_factory=list)  # in memory, least recently used first
    active: list[str] = msgspec.field(default_factory=list)  # used by running requests
    num_waiting_for_load: int = 0  # requests waiting for their adapter to load
    num_loads: int = 0
    num_load_failures: int = 0
    num_evictions: int = 0
    load_seconds: float = 0.0  # sum of load durations


class LoRALoadRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One finished adapter load, measured in the engine core (its loader thread).

    The API process turns it into metrics and a span after the fact, child of
    ``traceparent`` (the request, or the admin call, that caused the load).
    """

    adapter: str
    path: str
    start: float  # monotonic seconds
    end: float
    num_bytes: int = 0  # bytes read from disk
    cause: str = "request"  # 'request' | 'admin' | 'startup'
    request_id: str | None = None  # the request that caused it
    traceparent: str | None = None
    ticket: int = 0  # > 0: answers the ``lora_load`` EngineControl that got this ticket
    error: str | None = None  # None: loaded


class EngineControl(msgspec.Struct, kw_only=True):
    """An operator command for the engine core, run between two steps (admin routes)."""

    id: int  # echoed in the reply
    command: str  # 'kv_checkpoint', 'profile_start', 'profile_stop', 'lora_load', ... (``sluice.server.engine_proc._control``)
    args: dict[str, Any] = msgspec.field(default_factory=dict)  # e.g. lora_load: name, path, traceparent


class EngineControlReply(msgspec.Struct, kw_only=True):
    id: int
    result: dict[str, Any] = msgspec.field(default_factory=dict)
    error: EngineError | None = None


class EngineCoreProtocol(Protocol):
    """An engine core: requests in, one step of outputs at a time, stats snapshots."""

    @property
    def model_info(self) -> ModelInfo: ...

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ``InvalidRequestError`` (or a subclass) and keeps nothing when it is invalid."""

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); each gets a final output at the next step."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[EngineOutput]:
        """Run one step: schedule -> execute -> update."""

    def set_arrivals(
        self, take_arrivals: Callable[[], None], publish: Callable[[list[EngineOutput]], None]
    ) -> None:
        """Let a step take arrivals while it runs and publish early outputs (NOTE(mid-step-express) in
        sluice.engine.core); the engine core process calls it once, before the first step."""

    def make_stats(self) -> EngineStats: ...

    def load_lora_adapter(self, name: str, path: str, traceparent: str | None = None) -> int:
        """Start loading (and then registering) an adapter off the step loop; returns the ticket of
        the ``LoRALoadRecord`` that reports the result.  Raises ``InvalidRequestError`` at once for
        what needs no load (a name already taken by another path)."""

    def unload_lora_adapter(self, name: str) -> None:
        """Unregister an adapter: new requests for it are refused; running ones finish.
        Raises ``ModelNotFoundError`` for an unknown name."""

    def take_lora_loads(self) -> list[LoRALoadRecord]:
        """Loads finished since the last call."""

    def has_pending_lora_loads(self) -> bool: ...

    def kv_checkpoint(self) -> dict[str, Any]:
        """Write every cached prefix block the KV tier lacks, now; a JSON-able report."""

    def close(self, checkpoint: bool = True) -> None:
        """Release background resources (KV tier threads); ``checkpoint``: save what the tier lacks first."""
