"""The life of an OpenAI request inside the API process (DESIGN.md, steps 1-5).

    body -> schema -> model -> priority (capped by the key's tier) -> constraint, tools
         -> tokenize -> context check -> rate limit -> admission -> engine -> deltas -> response

``OpenAIServing.handle()`` returns either a finished JSON document or an SSE
body generator; the route (``routes.py``) wraps it in a response.  Everything a
request holds (engine requests, admission slot, in-flight slot, span) is
released in ``_finish``, whatever way it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from sluice.auth import KeyInfo, KeyStore, RateLimiter
from sluice.engine.config import ModelInfo
from sluice.engine.protocol import EngineRequest, SamplingParams, StructuredOutputs
from sluice.engine.validation import validate_prompt, validate_request
from sluice.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.obs.logging import REQUEST_LOGGER
from sluice.obs.tracing import Tracing
from sluice.server.admission import OVERDUE_FACTOR, OVERDUE_SWEEP_S
from sluice.server.codec import ModelCodec, TextCodec
from sluice.server.generation import Choice, Generation
from sluice.server.lanes import AnyAdmission, AnyClient
from sluice.server.protocol import ChatCompletionRequest, CompletionRequest
from sluice.server.render import SSE_DONE, ChatRenderer, CompletionRenderer, Renderer, sse_event
from sluice.server.structured import GrammarValidator, build_structured, llguidance_grammar
from sluice.server.telemetry import ServerMetrics, record_stages
from sluice.server.tools import (
    ToolCallParser,
    ToolPlan,
    plan_tools,
    template_is_native,
    template_messages,
    tool_grammar,
)
from sluice.types import Priority, parse_priority

__all__ = ["OpenAIServing", "RequestContext", "Prepared"]

log = logging.getLogger("sluice.server")
request_log = logging.getLogger(REQUEST_LOGGER)

# NOTE(tokenize-offload): short prompts tokenize in well under a millisecond, so
# they stay on the event loop; long ones go to a worker thread.
TOKENIZE_INLINE_CHARS = 8192


@dataclass
class RequestContext:
    request_id: str  # x-request-id: the client's, echoed (not necessarily unique)
    arrival: float  # monotonic
    span: Span
    # NOTE(uid): engine request ids and queue keys use a server-made unique id, so two
    # clients sending the same x-request-id never share a stream.
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    key: KeyInfo | None = None
    priority: Priority = Priority.P1
    status: int = 200  # HTTP status for metrics / logs; 499: client went away
    prompt_tokens: int = 0
    stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Prepared:
    kind: str  # 'completion' | 'chat'
    request: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    sampling: SamplingParams
    lora_name: str | None = None  # the LoRA adapter the request's model names; None: the base model
    tool_plan: ToolPlan | None = None  # a chat request whose answer may hold tool calls
    constraint_param: str | None = None  # the request field its output constraint came from


class OpenAIServing:
    def __init__(
        self,
        *,
        client: AnyClient,
        codec: TextCodec,
        model_info: ModelInfo,
        served_model_name: str,
        model_aliases: set[str],
        keys: KeyStore,
        rate_limiter: RateLimiter,
        admission: AnyAdmission,
        metrics: ServerMetrics,
        tracing: Tracing,
        is_draining: Callable[[], bool],
    ):
        self.client = client
        self.codec = codec
        self.model_info = model_info
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, *model_aliases}
        self.lora_adapters: dict[str, str] = {}  # LoRA adapter name -> path, as the engine registered them
        self.keys = keys
        self.rate_limiter = rate_limiter
        self.admission = admission
        self.metrics = metrics
        self.tracing = tracing
        self.is_draining = is_draining
        self.inflight: dict[str, Generation] = {}  # RequestContext.uid -> generation
        self._stall_swept_at = float("-inf")  # NOTE(stalled)
        self._token_text_cache: dict[int, str] = {}
        self.grammars = GrammarValidator()
        self._is_native_tools: bool | None = None  # NOTE(tool-format) in sluice.server.tools; None: not probed yet

    # -- request preparation -------------------------------------------------------

    def check_available(self) -> None:
        if self.is_draining():
            raise ServiceUnavailableError("server is shutting down; retry on another replica", retry_after=1.0)
        if self.client.is_dead:
            raise ServiceUnavailableError("the engine core is not running", retry_after=1.0)

    def authenticate(self, ctx: RequestContext, authorization: str | None) -> None:
        ctx.key = self.keys.authenticate(authorization)

    def resolve_priority(self, ctx: RequestContext, header: str | None, body: str | int | None) -> None:
        raw = header if header is not None else body
        try:
            p = parse_priority(raw)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="priority") from None
        assert ctx.key is not None
        ctx.priority = ctx.key.cap(p)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); ``ModelNotFoundError`` for anything else."""
        if model is None or model in self.model_names:
            return None
        if model in self.lora_adapters:
            return model
        available = ", ".join(repr(m) for m in [self.served_model_name, *sorted(self.lora_adapters)])
        raise ModelNotFoundError(f"model {model!r} is not served here; available: {available}")

    async def prepare(self, ctx: RequestContext, req: CompletionRequest | ChatCompletionRequest) -> Prepared:
        # NOTE(validate-offload): compiling a constraint takes from well under a millisecond
        # (a cached verdict) to tens of milliseconds (a large schema), so it runs on a
        # worker thread; a request without one pays nothing
        if _has_constraint(req):
            structured, plan, constraint_param = await asyncio.to_thread(self.constraint, req)
        else:
            structured, plan, constraint_param = None, None, None
        span = self.tracing.tracer.start_span("tokenize", context=_ctx_of(ctx.span))
        try:
            prompts = await self._tokenize(req, plan)
        finally:
            span.end()
        info = self.model_info
        for p in prompts:
            validate_prompt(p, info)
        longest = max(prompts, key=len)
        if isinstance(req, ChatCompletionRequest):
            # NOTE(chat-default): OpenAI chat has no fixed default
            sampling = req.sampling_params(info.max_model_len - len(longest))
            kind = "chat"
        else:
            sampling = req.sampling_params(16)
            kind = "completion"
        sampling.structured = structured
        if structured is not None:
            ctx.extra["constraint"] = "tools" if plan is not None else structured.kind()
        # the engine core's own check, answered here without the round trip
        validate_request(longest, sampling, info, int(ctx.priority))
        ctx.prompt_tokens = sum(len(p) for p in prompts)
        ctx.stream = req.stream
        return Prepared(kind, req, prompts, sampling, tool_plan=plan, constraint_param=constraint_param)

    def constraint(
        self, req: CompletionRequest | ChatCompletionRequest
    ) -> tuple[StructuredOutputs | None, ToolPlan | None, str | None]:
        """The request's output constraint (validated: a 400 naming the parameter), its tool plan,
        and the request field the constraint came from."""
        structured, param = build_structured(req.response_format, req.structured_outputs, req.guided(), self.grammars)
        plan = plan_tools(req) if isinstance(req, ChatCompletionRequest) else None
        if plan is None:
            return structured, None, param
        if structured is not None:
            raise InvalidRequestError(f"{param} cannot be combined with tools unless tool_choice is 'none'",
                                      param=param)  # fmt: skip
        tools = StructuredOutputs(grammar=tool_grammar(plan))
        assert tools.grammar is not None
        verdict = self.grammars.reason("grammar", tools.grammar, lambda: llguidance_grammar(tools))
        if verdict:  # a function's parameters that llguidance cannot hold the arguments to
            raise InvalidRequestError(f"tools: a function's parameters schema is not supported: {verdict}",
                                      param="tools")  # fmt: skip
        return tools, plan, "tools"

    def _is_native(self) -> bool:
        """Whether the chat template takes tools in sluice's call format (probed once)."""
        if self._is_native_tools is None:
            codec = self.codec
            self._is_native_tools = isinstance(codec, ModelCodec) and template_is_native(
                lambda m, t: codec.apply_chat_template(m, add_generation_prompt=True, tools=t)
            )
        return self._is_native_tools

    async def _tokenize(self, req: CompletionRequest | ChatCompletionRequest, plan: ToolPlan | None = None) -> list[list[int]]:
        codec = self.codec
        if isinstance(req, ChatCompletionRequest):
            native = (plan is not None or any(m.tool_calls or m.role == "tool" for m in req.messages)) and self._is_native()
            msgs, tools = template_messages(req, plan, native)
            size = sum(len(m["content"]) for m in msgs)

            def work_chat() -> list[list[int]]:
                if tools is not None and isinstance(codec, ModelCodec):
                    text = codec.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt, tools=tools)
                else:
                    text = codec.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
                # NOTE(chat-bos): the chat template already wrote any BOS it wants.
                return [codec.encode(text, add_special_tokens=False)]

            return work_chat() if size < TOKENIZE_INLINE_CHARS else await asyncio.to_thread(work_chat)
        items = req.prompts()
        size = sum(len(p) for p in items if isinstance(p, str))

        def work() -> list[list[int]]:
            return [codec.encode(p) if isinstance(p, str) else list(p) for p in items]

        return work() if size < TOKENIZE_INLINE_CHARS else await asyncio.to_thread(work)

    # -- submission ----------------------------------------------------------------

    def submit(self, ctx: RequestContext, prep: Prepared) -> Generation:
        sp = prep.sampling
        n = sp.n
        assert ctx.key is not None
        num_tokens = sum(len(p) + sp.max_tokens * n for p in prep.prompts)
        self.rate_limiter.check(ctx.key, num_tokens)
        num_prompt_tokens = sum(len(p) * n for p in prep.prompts)
        label = ctx.priority.label
        self.shed_overdue()
        try:
            decision = self.admission.admit(ctx.uid, ctx.priority, num_tokens, num_prompt_tokens, prep.prompts)
        except OverloadedError as e:
            self.metrics.observe_rejected(label, e.code or "overloaded")
            raise
        for victim in decision.shed:
            self._shed(victim)
        ttft_target = decision.target or 0.0
        if decision.predicted_ttft is not None:
            ctx.extra["predicted_ttft"] = decision.predicted_ttft
            self.metrics.observe_prediction(label, decision.predicted_ttft)
        if decision.target is not None:
            ctx.extra["slo_target"] = decision.target
        reqs: list[EngineRequest] = []
        choices: list[Choice] = []
        trace_id = format(ctx.span.get_span_context().trace_id, "032x")
        # NOTE(lora-trace): the engine reports an adapter load this request causes with this
        # context, and the load's span becomes a child of the request's span
        traceparent = self.tracing.traceparent(ctx.span) if prep.lora_name is not None else None
        for pi, prompt in enumerate(prep.prompts):
            for j in range(n):
                index = pi * n + j
                rid = f"{ctx.uid}-{index}"
                # NOTE(n-seeds): with a seed and n > 1, choice j uses seed + j so the
                # choices differ yet the whole response stays reproducible.
                seed = None if sp.seed is None else (sp.seed + j) % (2**63)
                params = SamplingParams(**{**_fields(sp), "n": 1, "seed": seed})
                reqs.append(
                    EngineRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling=params,
                        priority=int(ctx.priority),
                        arrival_time=ctx.arrival,
                        trace_id=trace_id,
                        ttft_target=ttft_target,
                        lora_name=prep.lora_name,
                        traceparent=traceparent,
                    )
                )
                det = self.codec.detokenizer(list(sp.stop), sp.skip_special_tokens, prompt)
                choices.append(Choice(index, rid, pi, det, tools=ToolCallParser() if prep.tool_plan else None))
        self.metrics.prompt_tokens.inc(ctx.prompt_tokens)
        try:
            stream = self.client.add_requests(reqs, lane=decision.lane)
        except SluiceError:
            self.admission.remove(ctx.uid)
            raise
        gen = Generation(
            self.client,
            stream,
            choices,
            arrival=ctx.arrival,
            keep_text=not prep.request.stream,
            on_started=lambda: self.admission.started(ctx.uid),
            priority_label=label,
            on_choice_done=lambda c: self._choice_done(ctx, c, label),
            stall_limit=None if ctx.priority == Priority.P0 or decision.target is None
            else OVERDUE_FACTOR * decision.target,  # NOTE(stalled)
        )
        self.inflight[ctx.uid] = gen
        self.metrics.queued.set(self.admission.num_queued)
        return gen

    def shed_overdue(self) -> None:
        """Answer with 429 the queued requests that waited far past their class's target
        (NOTE(overdue) in admission), and shed the started ones that stalled; called at each
        arrival and each engine step.

        NOTE(stalled): the queue sweep ends when a request's first output comes.  A
        started request of a class below P0 can still be preempted by a higher class
        (the engine's NOTE(take-from-lower)) and, while the higher classes fill the
        engine, not be resumed at all: under 5x overload a P2 hung until the client's
        timeout, long past the queue's sweep.  So a started
        request below P0 with no output for ``OVERDUE_FACTOR`` times its class's
        target is shed like an overdue one (code ``expired``, a jittered
        ``Retry-After``; a stream gets an error event, then ``[DONE]``), and its engine
        request is aborted.  P0 is never shed this way.
        """
        for request_id in self.admission.overdue():
            self._shed(request_id, "no first token after twice its class's TTFT target: shed behind "
                                   "higher-priority work", "expired")  # fmt: skip
        now = time.monotonic()
        if now - self._stall_swept_at < OVERDUE_SWEEP_S:
            return
        self._stall_swept_at = now
        for uid in [uid for uid, gen in self.inflight.items() if gen.is_stalled(now)]:
            self._shed(uid, "preempted by higher-priority work and not resumed for twice its class's TTFT "
                            "target: shed", "expired")  # fmt: skip

    def _shed(
        self,
        request_id: str,
        message: str = "shed by admission control to make room for a higher-priority request",
        code: str = "shed",
    ) -> None:
        gen = self.inflight.get(request_id)
        if gen is None:
            return
        gen.close()
        self.metrics.observe_rejected(gen.priority_label, code)
        gen.stream.fail(
            OverloadedError(message, retry_after=self.admission.jittered(self.admission.retry_after), code=code)
        )

    def _choice_done(self, ctx: RequestContext, c: Choice, label: str) -> None:
        self.metrics.observe_finished(label, c.timings, c.num_tokens)
        self.admission.observe_output_tokens(c.num_tokens)
        t = c.timings
        if c.index == 0 and t is not None and t.ttft is not None:
            predicted = ctx.extra.get("predicted_ttft")
            if predicted is not None:
                self.metrics.observe_prediction_error(label, t.ttft - predicted)
        t = c.timings
        if t is not None:
            record_stages(self.tracing, ctx.span, t, {"sluice.choice": c.index, "sluice.priority": label})

    # -- responses -----------------------------------------------------------------

    def renderer(self, ctx: RequestContext, prep: Prepared) -> Renderer:
        cls = ChatRenderer if prep.kind == "chat" else CompletionRenderer
        prefix = "chatcmpl-" if prep.kind == "chat" else "cmpl-"
        return cls(prefix + ctx.request_id, prep.lora_name or self.served_model_name, int(time.time()), self.token_text)

    def token_text(self, token_id: int) -> str:
        s = self._token_text_cache.get(token_id)
        if s is None:
            s = self.codec.decode([token_id], skip_special_tokens=False)
            if len(self._token_text_cache) < 65536:
                self._token_text_cache[token_id] = s
        return s

    @staticmethod
    def _name_constraint(e: SluiceError, prep: Prepared) -> SluiceError:
        """An engine-side constraint error names the request's own field (``tools``, ``response_format...``)."""
        if isinstance(e, InvalidRequestError) and e.param == "structured_outputs" and prep.constraint_param:
            e.param = prep.constraint_param
        return e

    async def collect(self, ctx: RequestContext, prep: Prepared, gen: Generation) -> dict[str, Any]:
        try:
            async for _ in gen.deltas():
                pass
        except SluiceError as e:
            raise self._name_constraint(e, prep) from None
        return self.renderer(ctx, prep).full(gen.choices, ctx.prompt_tokens)

    async def first_events(self, ctx: RequestContext, prep: Prepared, gen: Generation) -> tuple[list[bytes], Renderer, Any]:
        """Wait for the first deltas (errors so far still become HTTP errors)."""
        r = self.renderer(ctx, prep)
        it = gen.deltas().__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = []
        except SluiceError as e:
            raise self._name_constraint(e, prep) from None
        return [sse_event(r.chunk(d)) for d in first], r, it

    async def stream_body(
        self, ctx: RequestContext, prep: Prepared, gen: Generation, first: list[bytes], r: Renderer, it: Any
    ) -> AsyncGenerator[bytes, None]:
        req = prep.request
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            for ev in first:
                yield ev
            try:
                async for deltas in it:
                    for d in deltas:
                        yield sse_event(r.chunk(d))
            except SluiceError as e:
                self._name_constraint(e, prep)
                ctx.status = e.status_code
                yield sse_event(e.to_openai())
                yield SSE_DONE
                return
            if include_usage:
                yield sse_event(r.usage_chunk(ctx.prompt_tokens, gen.num_generated))
            yield SSE_DONE
        finally:
            await it.aclose()
            self.finish(ctx, gen)

    def finish(self, ctx: RequestContext, gen: Generation | None) -> None:
        """Release everything the request holds; log and count it (idempotent per request)."""
        if ctx.extra.get("finished"):
            return
        ctx.extra["finished"] = True
        if gen is not None:
            if not gen.is_done and ctx.status == 200:
                ctx.status = 499
            gen.close()
            self.inflight.pop(ctx.uid, None)
        self.admission.remove(ctx.uid)
        self.metrics.queued.set(self.admission.num_queued)
        label = ctx.priority.label
        self.metrics.count_request(ctx.status, label)
        self.metrics.observe_slo(label, self._slo_met(ctx, gen))
        span = ctx.span
        span.set_attribute("http.response.status_code", ctx.status)
        span.set_attribute("sluice.priority", label)
        if ctx.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        fields: dict[str, Any] = {
            "request_id": ctx.request_id,
            "status": ctx.status,
            "priority": label,
            "key": ctx.key.name if ctx.key else None,
            "model": ctx.extra.get("lora_name") or self.served_model_name,
            "stream": ctx.stream,
            "prompt_tokens": ctx.prompt_tokens,
            "completion_tokens": gen.num_generated if gen else 0,
            "e2e_s": round(time.monotonic() - ctx.arrival, 6),
        }
        if gen is not None and gen.choices:
            c = gen.choices[0]
            t = c.timings
            fields["finish_reasons"] = [ch.finish_reason for ch in gen.choices]
            if t is not None:
                fields["queue_s"] = _dur(t.arrival, t.first_scheduled)
                fields["prefill_s"] = _dur(t.first_scheduled, t.first_token)
                fields["decode_s"] = _dur(t.first_token, t.finished)
                fields["ttft_s"] = _dur(t.arrival, t.first_token)
        if ctx.extra.get("constraint"):
            fields["constraint"] = ctx.extra["constraint"]  # 'json', 'regex', ... or 'tools'
        if ctx.extra.get("error"):
            fields["error"] = ctx.extra["error"]
        request_log.info("request", extra={"fields": fields})


    @staticmethod
    def _slo_met(ctx: RequestContext, gen: Generation | None) -> bool:
        """Served within its class's TTFT target (a rejected or failed request misses it)."""
        target = ctx.extra.get("slo_target")
        if ctx.status != 200 or gen is None or not gen.choices:
            return False
        t = gen.choices[0].timings
        ttft = None if t is None else t.ttft
        return ttft is not None and (target is None or ttft <= target)


def _has_constraint(req: CompletionRequest | ChatCompletionRequest) -> bool:
    if isinstance(req, ChatCompletionRequest) and (req.tools or req.tool_choice is not None):
        return True
    return (req.response_format is not None or req.structured_outputs is not None
            or any(v is not None for v in req.guided().values()))  # fmt: skip


def _dur(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(max(0.0, b - a), 6)


def _fields(sp: SamplingParams) -> dict[str, Any]:
    return {f: getattr(sp, f) for f in sp.__struct_fields__}


def _ctx_of(span: Span) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def new_request_id() -> str:
    return uuid.uuid4().hex
