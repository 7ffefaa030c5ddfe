"""OpenAI request schemas (pydantic, the HTTP edge only).

Strict types (``"5"`` is not an int) and unknown fields rejected, as OpenAI
does; every failure becomes a 400 naming the parameter.  ``sampling_params()``
turns a request into the engine's ``SamplingParams`` (which validates ranges).
Output constraints (``response_format``, vLLM's ``structured_outputs`` and
``guided_*``) are read by ``sluice.server.structured``, tools and tool calls by
``sluice.server.tools``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.engine.protocol import SamplingParams
from sluice.errors import InvalidRequestError

__all__ = [
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "StreamOptions",
    "Tool",
    "ToolCall",
    "FunctionDef",
    "NamedToolChoice",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    parsed_arguments: Any = None  # the openai client's own, on a replayed message: ignored


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # left on a call accumulated from a stream: ignored


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # sluice always holds the arguments to the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    # NOTE(replayed-message): the openai client sends an answer's message back as it came,
    # with its response-only fields; they are taken and ignored
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    parsed: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Common(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: str | int | None = None  # p0 / p1 / p2 (capped by the API key's tier)
    logit_bias: dict[str, float] | None = None
    # output constraints (sluice.server.structured): OpenAI's, then vLLM's extras
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guided(self) -> dict[str, Any]:
        return {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}  # fmt: skip

    def _stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.n > 16:
            raise InvalidRequestError(f"n must be <= 16, got {self.n}", param="n")
        stops = self._stop_list()
        if len(stops) > 8:
            raise InvalidRequestError("at most 8 stop sequences", param="stop")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stops,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # OpenAI default: 16
    logprobs: int | None = None  # 0..5 in OpenAI (we allow up to 20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def sampling_params(self, max_tokens_default: int) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of not in (None, self.n):
            raise InvalidRequestError("best_of must equal n", param="best_of")
        mt = self.max_tokens if self.max_tokens is not None else max_tokens_default
        return self._sampling(mt, self.logprobs)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True

    def sampling_params(self, max_tokens_default: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs: true", param="top_logprobs")
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(mt if mt is not None else max_tokens_default, lp)
