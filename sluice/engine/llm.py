"""The offline API: ``sluice.LLM``, the engine core driven in-process.

    from sluice import LLM, SamplingParams
    llm = LLM("smollm2")
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].text, outs[0].finish_reason, outs[0].timings.ttft)
    print(llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].text)

    llm = LLM("smollm2", lora_modules=["sql=/adapters/sql"])           # LoRA adapters (docs/lora.md)
    llm.load_lora_adapter("chat", "/adapters/chat")
    outs = llm.generate(["q1", "q2", "q3"], lora=["sql", None, "chat"])  # None: the base model
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.config import EngineConfig
from sluice.engine.core import EngineCore
from sluice.engine.protocol import (
    EngineOutput,
    EngineRequest,
    RequestTimings,
    SamplingParams,
    TokenLogprobs,
)
from sluice.engine.stop import apply_output
from sluice.errors import InvalidRequestError, from_parts
from sluice.models.loader import resolve_model
from sluice.models.tokenizer import IncrementalDetokenizer, load_tokenizer
from sluice.types import Priority, parse_priority

__all__ = ["LLM", "RequestOutput", "CompletionOutput"]

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    timings: RequestTimings | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class _Seq:
    parent: int  # index of the prompt
    index: int  # completion index within its prompt (n > 1)
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    last: EngineOutput | None = None


class LLM:
    def __init__(self, model: str = "smollm2", **engine_args: Any):
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        for k in engine_args:
            if k not in names:
                raise TypeError(f"LLM() got an unexpected argument {k!r}")
        cfg = EngineConfig(model=model, **{k: v for k, v in engine_args.items() if v is not None})
        # NOTE(llm-eos): the tokenizer may know end-of-sequence ids the model config
        # does not; the engine stops on both.
        self.tokenizer = load_tokenizer(resolve_model(model))
        self.engine = EngineCore(cfg, extra_eos_token_ids=self.tokenizer.eos_token_ids)

    # ------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: str | int | Priority | Sequence[str | int | Priority] | None = None,
        lora: str | Sequence[str | None] | None = None,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """``lora``: a LoRA adapter name for every prompt, or one per prompt (None: the base model)."""
        plist = self._normalize_prompts(prompts)
        n = len(plist)
        params_list = self._broadcast(params or SamplingParams(), n, "params")
        prio_list = self._broadcast(priority, n, "priority")
        lora_list = self._broadcast(lora, n, "lora")
        ids_list = [self._encode(p) for p in plist]
        return self._run(plist, ids_list, params_list, prio_list, progress, lora_list)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load and register a LoRA adapter (PEFT directory); returns once it is in memory.
        Raises ``InvalidRequestError`` naming the problem (bad path, another base model, rank too high)."""
        ticket = self.engine.load_lora_adapter(name, path)
        while True:
            for rec in self.engine.take_lora_loads():
                if rec.ticket == ticket:
                    if rec.error is not None:
                        raise from_parts("invalid_request_error", rec.error, param="lora_path", code="invalid_lora_adapter")
                    return
            self.engine.step()

    def unload_lora_adapter(self, name: str) -> None:
        """Unregister an adapter; raises ``ModelNotFoundError`` for an unknown name."""
        self.engine.unload_lora_adapter(name)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self.generate(ids, params, **kwargs)

    def stream(self, prompt: str, params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated."""
        params = params or SamplingParams()
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self._encode(prompt)
        rid = uuid.uuid4().hex
        self.engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=params))
        detok = self.tokenizer.detokenizer(params.stop, params.skip_special_tokens, ids)
        done = False
        while not done:
            for out in self.engine.step():
                if out.request_id != rid:
                    continue
                delta = apply_output(detok, out)
                if delta.text:
                    yield delta.text
                if delta.needs_abort:
                    self.engine.abort([rid])
                    self.engine.step()
                done = delta.finish_reason is not None

    # ------------------------------------------------------------ internals

    @staticmethod
    def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # type: ignore[arg-type]
        out: list[Prompt] = list(prompts)  # type: ignore[arg-type]
        if not out:
            raise InvalidRequestError("no prompts given", param="prompt")
        for p in out:
            if not isinstance(p, str) and not (isinstance(p, Sequence) and all(isinstance(t, int) for t in p)):
                raise InvalidRequestError("each prompt must be a string or a list of token ids", param="prompt")
        return out

    @staticmethod
    def _broadcast(value: Any, n: int, name: str) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise InvalidRequestError(f"{name}: got {len(value)} values for {n} prompts", param=name)
            return list(value)
        return [value] * n

    def _encode(self, p: Prompt) -> list[int]:
        return self.tokenizer.encode(p) if isinstance(p, str) else list(p)

    def _run(
        self,
        prompts: list[Prompt],
        ids_list: list[list[int]],
        params_list: list[SamplingParams],
        prio_list: list[Any],
        progress: bool | None,
        lora_list: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        seqs: dict[str, _Seq] = {}
        added: list[str] = []
        try:
            loras = lora_list or [None] * len(ids_list)
            for i, (ids, sp, pr, lo) in enumerate(zip(ids_list, params_list, prio_list, loras)):
                for j in range(sp.n):
                    rid = f"{uuid.uuid4().hex}-{i}-{j}"
                    sub = sp if sp.n == 1 else _with(sp, n=1, seed=None if sp.seed is None else sp.seed + j)
                    self.engine.add_request(
                        EngineRequest(
                            request_id=rid, prompt_token_ids=ids, sampling=sub, priority=int(parse_priority(pr)),
                            lora_name=lo,
                        )
                    )
                    added.append(rid)
                    seqs[rid] = _Seq(i, j, self.tokenizer.detokenizer(sp.stop, sp.skip_special_tokens, ids))
        except Exception:
            self.engine.abort(added)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        self._drain(seqs, progress if progress is not None else len(seqs) >= 16)
        results: list[RequestOutput] = []
        for i, (p, ids) in enumerate(zip(prompts, ids_list)):
            mine = sorted((s for s in seqs.values() if s.parent == i), key=lambda s: s.index)
            last = mine[0].last
            results.append(
                RequestOutput(
                    request_id=next(r for r, s in seqs.items() if s is mine[0]),
                    prompt=p if isinstance(p, str) else None,
                    prompt_token_ids=list(ids),
                    outputs=[
                        CompletionOutput(s.index, s.detok.text, s.token_ids, s.finish_reason, s.logprobs or None)
                        for s in mine
                    ],
                    num_cached_tokens=last.num_cached_tokens if last else 0,
                    num_preemptions=last.num_preemptions if last else 0,
                    timings=last.timings if last else None,
                )
            )
        return results

    def _drain(self, seqs: dict[str, _Seq], show: bool) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        pending = set(seqs)
        with Progress(
            TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            disable=not show, transient=True,
        ) as bar:
            task = bar.add_task("gen", total=len(pending))
            while pending:
                for out in self.engine.step():
                    s = seqs.get(out.request_id)
                    if s is None:
                        continue
                    if out.error is not None:  # e.g. its adapter failed to load
                        self.engine.abort(list(pending))
                        while self.engine.has_unfinished_requests():
                            self.engine.step()
                        raise out.error.to_exception()
                    s.last = out
                    s.token_ids.extend(out.new_token_ids)
                    if out.logprobs:
                        s.logprobs.extend(out.logprobs)
                    delta = apply_output(s.detok, out)
                    if s.finish_reason is None:
                        s.finish_reason = delta.finish_reason
                    if delta.needs_abort:
                        self.engine.abort([out.request_id])
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        bar.advance(task)


def _with(sp: SamplingParams, **changes: Any) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(sp, **changes)
