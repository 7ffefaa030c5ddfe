"""Fakes for server tests: a deterministic engine core and a byte-level codec.

``FakeEngineCore`` implements ``EngineCoreProtocol`` like ``EngineCore`` and
runs in the real engine core process (spawned, over real ZMQ), so
fault-injection tests (engine death, drain, hundreds of clients) exercise the
real server without a model:

- one token per running request per step, after ``step_delay`` seconds; a free
  slot goes to the most urgent class waiting (no preemption, unless ``preempt``:
  then a waiting request with no free slot takes the slot of the newest running
  request of the lowest class below its own, which waits again with its output
  kept, as the engine's NOTE(take-from-lower));
- greedy (temperature 0): letters ``a..z`` cycling from ``sum(prompt) % 26``;
  sampled: letters from ``random.Random(seed)`` (reproducible with a seed);
- KV accounting like the real engine: ``ceil(tokens / 16)`` blocks per request;
- the real engine's request validation (``sluice.engine.validation``);
- LoRA adapters by name (``--lora-modules``, the load endpoint): any existing
  directory loads (after ``lora_load_delay`` seconds, off the step loop like the
  real engine), requests for an unknown name are refused with 404.

``FakeCodec`` is a byte tokenizer: ids 0..255 are bytes, 256 is BOS, 257 EOS.

``python -m sluice.server.testing --port 0 [--step-delay S]`` serves it (used by
the tests that need a separate process: SIGTERM drain, engine kill).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.engine.config import BLOCK_SIZE, EngineConfig, ModelInfo
from sluice.engine.protocol import (
    EngineCoreProtocol,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    LoRALoadRecord,
    LoRAStats,
    RequestTimings,
    TokenLogprobs,
)
from sluice.engine.validation import validate_request
from sluice.errors import InvalidRequestError, ModelNotFoundError

__all__ = ["FakeEngineCore", "FakeCodec", "FakeDetokenizer", "BOS", "EOS", "VOCAB_SIZE"]

BOS, EOS, VOCAB_SIZE = 256, 257, 258


@dataclass
class _Req:
    req: EngineRequest
    rng: random.Random
    output: list[int] = field(default_factory=list)
    num_blocks: int = 0
    timings: RequestTimings | None = None


class FakeEngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        step_delay: float = 0.0,
        num_blocks: int = 4096,
        max_model_len: int = 512,
        load_delay: float = 0.0,
        lora_load_delay: float = 0.0,
        busy_step: bool = False,  # spin through step_delay (CPU work a sampling profiler sees) instead of sleeping
        mid_step: bool = False,  # halfway through a step, start arrived P0s at once (the engine's NOTE(mid-step-express))
        preempt: bool = False,  # a higher class takes a lower one's slot (the engine's NOTE(take-from-lower))
    ):
        time.sleep(load_delay)  # a slow model load, for /health tests
        self.config = config
        self.step_delay = step_delay
        self.busy_step = busy_step
        self.mid_step = mid_step
        self.preempt = preempt
        self.num_preemptions = 0
        self.num_batched_tokens_total = 0
        self._arrivals: Callable[[], None] | None = None
        self._publish: Callable[[list[EngineOutput]], None] | None = None
        self.max_model_len = config.max_model_len or max_model_len
        self.model_info = ModelInfo(
            name="fake",
            path="fake",
            max_model_len=self.max_model_len,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=(EOS,),
            dtype="float32",
            device="cpu",
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            attention_backend="fake",
        )
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.to_abort: set[str] = set()
        self.num_steps = 0
        self.lora_load_delay = lora_load_delay
        self.adapters: dict[str, str] = dict(config.lora_module_paths)  # name -> path
        self.pending_loads: list[LoRALoadRecord] = []  # loading: done at .end
        self.lora_records: list[LoRALoadRecord] = []
        self.num_lora_loads = 0
        self.next_ticket = 1

    # -- EngineCore interface ------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        validate_request(req.prompt_token_ids, req.sampling, self.model_info, req.priority)
        if req.lora_name is not None and req.lora_name not in self.adapters:
            raise ModelNotFoundError(f"model {req.lora_name!r} is not served here (no such LoRA adapter)")
        if req.arrival_time == 0.0:
            req.arrival_time = time.monotonic()
        rng = random.Random(req.sampling.seed)  # seed None: OS entropy
        self.waiting.append(_Req(req, rng, timings=RequestTimings(arrival=req.arrival_time)))

    def abort(self, request_ids: Iterable[str]) -> None:
        self.to_abort.update(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.to_abort)

    def set_arrivals(self, take_arrivals: Callable[[], None], publish: Callable[[list[EngineOutput]], None]) -> None:
        self._arrivals, self._publish = take_arrivals, publish

    def _mid_step_p0s(self) -> None:
        """Take arrivals; waiting P0s with a free slot get their first token now, published at once."""
        assert self._arrivals is not None and self._publish is not None
        self._arrivals()
        early = []
        for r in [r for r in self.waiting if r.req.priority == 0]:
            if len(self.running) >= self.config.max_num_seqs or not self._start(r, time.monotonic()):
                break
            early.append(self._emit(r))
        if early:
            self._publish(early)

    def _start(self, r: _Req, now: float) -> bool:
        need = math.ceil((len(r.req.prompt_token_ids) + len(r.output) + 1) / BLOCK_SIZE)  # a resumed one: its output too
        if need > self.num_free_blocks:
            return False
        self.waiting.remove(r)
        r.num_blocks = need
        self.num_free_blocks -= need
        self.num_batched_tokens_total += len(r.req.prompt_token_ids) + len(r.output)  # a resumed one recomputes
        assert r.timings is not None
        if r.timings.first_scheduled is None:
            r.timings.first_scheduled = now
        self.running.append(r)
        return True

    def step(self) -> list[EngineOutput]:
        if self.step_delay and self.mid_step and self._arrivals is not None:
            time.sleep(self.step_delay / 2)
            self._mid_step_p0s()
            time.sleep(self.step_delay / 2)
        elif self.step_delay and self.busy_step:
            end = time.perf_counter() + self.step_delay
            while time.perf_counter() < end:
                pass
        elif self.step_delay:
            time.sleep(self.step_delay)
        self.num_steps += 1
        self.num_batched_tokens_total += len(self.running)  # a token for each decode (prefills: in _start)
        outs: list[EngineOutput] = []
        now = time.monotonic()
        if self.to_abort:
            for queue in (self.waiting, self.running):
                for r in [r for r in queue if r.req.request_id in self.to_abort]:
                    queue.remove(r)
                    self._free(r)
                    outs.append(self._output(r, [], finish_reason=FinishReason.ABORT, now=now))
            self.to_abort.clear()
        self.waiting.sort(key=lambda r: r.req.priority)  # a free slot goes to the most urgent class (stable)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            if not self._start(self.waiting[0], now):
                break
        while self.preempt and self.waiting:
            r = self.waiting[0]
            lower = [v for v in self.running if v.req.priority > r.req.priority]
            if not lower:
                break
            victim = max(lower, key=lambda v: (v.req.priority, self.running.index(v)))  # lowest class, newest
            self.running.remove(victim)
            self._free(victim)
            self.waiting.append(victim)  # keeps its output; resumes when a slot is free
            self.waiting.sort(key=lambda w: w.req.priority)
            self.num_preemptions += 1
            if not self._start(r, now):
                break
        for r in list(self.running):
            outs.append(self._emit(r))
        return outs

    def _emit(self, r: _Req) -> EngineOutput:
        """The running request's next token (and its finish)."""
        tok = self._next_token(r)
        r.output.append(tok)
        self._grow(r)
        assert r.timings is not None
        if r.timings.first_token is None:
            r.timings.first_token = time.monotonic()
        sp = r.req.sampling
        lp = None
        if sp.logprobs is not None:
            alt = 97 + (tok - 97 + 1) % 26
            lp = [TokenLogprobs(tok, -0.25, [(tok, -0.25), (alt, -1.75)][: max(sp.logprobs, 0)])]
        reason = None
        if len(r.output) >= sp.max_tokens:
            reason = FinishReason.LENGTH
        elif tok in sp.stop_token_ids and len(r.output) >= sp.min_tokens:
            reason = FinishReason.STOP
        if reason is not None:
            self.running.remove(r)
            self._free(r)
        return self._output(r, [tok], lp, finish_reason=reason, now=time.monotonic())

    # -- LoRA adapters -------------------------------------------------------------

    def load_lora_adapter(self, name: str, path: str, traceparent: str | None = None) -> int:
        import os

        if name in self.adapters:
            raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded", param="lora_name")
        ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
        now = time.monotonic()
        error = None if os.path.isdir(path) else f"LoRA adapter path {path!r} is not a directory"
        self.pending_loads.append(LoRALoadRecord(adapter=name, path=path, start=now, end=now + self.lora_load_delay,
                                                 num_bytes=1024, cause="admin", traceparent=traceparent,
                                                 ticket=ticket, error=error))  # fmt: skip
        return ticket

    def unload_lora_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ModelNotFoundError(f"LoRA adapter {name!r} is not loaded", param="lora_name")

    def take_lora_loads(self) -> list[LoRALoadRecord]:
        now = time.monotonic()
        for rec in [r for r in self.pending_loads if r.end <= now]:
            self.pending_loads.remove(rec)
            if rec.error is None:
                self.adapters[rec.adapter] = rec.path
                self.num_lora_loads += 1
            self.lora_records.append(rec)
        out, self.lora_records = self.lora_records, []
        return out

    def has_pending_lora_loads(self) -> bool:
        return bool(self.pending_loads)

    def make_stats(self) -> EngineStats:
        used = self.num_blocks - self.num_free_blocks
        run = [0, 0, 0]
        wait = [0, 0, 0]
        for r in self.running:
            run[r.req.priority] += 1
        for r in self.waiting:
            wait[r.req.priority] += 1
        prefill = [0, 0, 0]
        for r in self.waiting:
            prefill[r.req.priority] += len(r.req.prompt_token_ids)
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_running_by_priority=run,
            num_waiting_by_priority=wait,
            kv_cache_usage=used / self.num_blocks,
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_steps=self.num_steps,
            num_batched_tokens_total=self.num_batched_tokens_total,
            num_preemptions=self.num_preemptions,
            num_decoding=len(self.running),
            num_decoding_by_priority=run,
            num_prefill_tokens_by_priority=prefill,
            # NOTE(fake-rates): a step takes step_delay whatever its size, and a
            # whole prompt is one step: the rates the admission tests predict from
            step_time_base=self.step_delay,
            max_num_batched_tokens=1 << 20,
            max_num_seqs=self.config.max_num_seqs,
            lora=LoRAStats(max_loras=self.config.max_loras, adapters=sorted(self.adapters),
                           loaded=sorted(self.adapters), num_loads=self.num_lora_loads),  # fmt: skip
        )

    def kv_checkpoint(self) -> dict[str, Any]:
        self.num_kv_checkpoints = getattr(self, "num_kv_checkpoints", 0) + 1
        return {"enabled": False, "reason": "fake engine", "num_written_blocks": 0}

    def close(self, checkpoint: bool = True) -> None:
        pass

    # -- internals -----------------------------------------------------------------

    def _next_token(self, r: _Req) -> int:
        if r.req.sampling.temperature == 0.0:
            start = sum(r.req.prompt_token_ids) % 26
            return 97 + (start + len(r.output)) % 26
        return 97 + r.rng.randrange(26)

    def _grow(self, r: _Req) -> None:
        need = math.ceil((len(r.req.prompt_token_ids) + len(r.output) + 1) / BLOCK_SIZE)
        if need > r.num_blocks:
            self.num_free_blocks -= need - r.num_blocks
            r.num_blocks = need

    def _free(self, r: _Req) -> None:
        self.num_free_blocks += r.num_blocks
        r.num_blocks = 0

    @staticmethod
    def _output(
        r: _Req,
        new_token_ids: list[int],
        logprobs: list[TokenLogprobs] | None = None,
        *,
        finish_reason: str | None,
        now: float,
    ) -> EngineOutput:
        out = EngineOutput(
            request_id=r.req.request_id,
            new_token_ids=new_token_ids,
            logprobs=logprobs,
            num_prompt_tokens=len(r.req.prompt_token_ids),
            num_generated_tokens=len(r.output),
        )
        if finish_reason is not None:
            assert r.timings is not None
            r.timings.finished = now
            out.finished, out.finish_reason, out.timings = True, finish_reason, r.timings
        return out


if TYPE_CHECKING:  # mypy checks that the fake is an engine core
    _fake_engine_core: type[EngineCoreProtocol] = FakeEngineCore


class FakeDetokenizer:
    """Byte-level incremental detokenizer with stop strings (UTF-8 safe)."""

    def __init__(self, stop: list[str], skip_special_tokens: bool = True):
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.pending = b""  # bytes not yet a whole UTF-8 sequence
        self.text = ""  # decoded, not yet emitted (held back for stop matching)
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.pending += bytes(t for t in token_ids if t < 256)
        try:
            self.text += self.pending.decode("utf-8")
            self.pending = b""
        except UnicodeDecodeError as e:
            self.text += self.pending[: e.start].decode("utf-8")
            self.pending = self.pending[e.start :]
        for s in self.stop:
            i = self.text.find(s)
            if i >= 0:
                self.stopped = True
                out, self.text = self.text[:i], ""
                return out
        cut = max(0, len(self.text) - self.holdback)
        out, self.text = self.text[:cut], self.text[cut:]
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self.text + self.pending.decode("utf-8", errors="replace")
        self.text, self.pending = "", b""
        return out


class FakeCodec:
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def detokenizer(
        self, stop: list[str], skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> FakeDetokenizer:
        return FakeDetokenizer(stop, skip_special_tokens)


def fake_codec_factory(model: str) -> FakeCodec:
    return FakeCodec()


def main(argv: list[str] | None = None) -> None:
    import argparse
    import functools

    from sluice.server.config import load_settings
    from sluice.server.runner import run_server

    p = argparse.ArgumentParser(description="sluice serve on the fake engine (tests only)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.01)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--cpu-affinity", default=None)
    p.add_argument("--api-key", action="append", default=[])
    p.add_argument("--keys-file", default=None)
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--pyroscope-server", default=None)
    args = p.parse_args(argv)
    settings = load_settings(
        model="fake", port=args.port, shutdown_timeout=args.shutdown_timeout, max_model_len=args.max_model_len,
        cpu_affinity=args.cpu_affinity, api_key=args.api_key, keys_file=args.keys_file, profile_dir=args.profile_dir,
        pyroscope_server=args.pyroscope_server,
    )
    run_server(
        settings,
        engine_factory=functools.partial(FakeEngineCore, step_delay=args.step_delay),
        codec_factory=fake_codec_factory,
    )


if __name__ == "__main__":
    main()
