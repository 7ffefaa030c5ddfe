"""The engine core: ``step()`` = schedule -> execute -> update.

Synchronous and single-threaded.  ``sluice serve`` runs it in its own process
behind ZeroMQ; ``sluice.LLM`` drives it in-process.  It knows no exporter: it
returns ``EngineOutput`` messages and ``make_stats()`` snapshots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import BLOCK_SIZE, EngineConfig, ModelInfo
from sluice.engine.model_runner import ModelRunner
from sluice.engine.protocol import EngineOutput, EngineRequest, EngineStats, FinishReason
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampler import SamplingRow
from sluice.engine.scheduler import Scheduler
from sluice.errors import ContextLengthError, InvalidRequestError
from sluice.models.loader import resolve_model

__all__ = ["EngineCore"]

log = logging.getLogger("sluice.engine")


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **overrides: object):
        config = config or EngineConfig()
        for k, v in overrides.items():
            setattr(config, k, v)
        config.validate()
        self.config = config
        self.source = resolve_model(config.model)
        self.runner = ModelRunner(config, self.source)
        cfg = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = self._eos_ids(cfg.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, BLOCK_SIZE, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, config.scheduling_policy
        )
        self.requests: dict[str, Request] = {}
        self.generators: dict[str, torch.Generator] = {}
        self._aborted: list[str] = []
        self._num_steps = 0
        self._last_step_time = 0.0
        self._last_batched = 0
        self.model_info = ModelInfo(
            name=self.source.name,
            path=str(self.source.path),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=config.device,
            num_blocks=self.runner.num_blocks,
            block_size=BLOCK_SIZE,
            attention_backend=self.runner.attention.name,
        )

    def _eos_ids(self, from_config: list[int]) -> list[int]:
        ids = set(from_config)
        gen_cfg = self.source.path / "generation_config.json" if self.source.kind == "hf" else None
        if gen_cfg is not None and gen_cfg.is_file():
            import json

            e = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
        return sorted(int(i) for i in ids)

    # ------------------------------------------------------------ requests

    def add_request(self, ereq: EngineRequest) -> None:
        rid = ereq.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}", param="request_id")
        n = len(ereq.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if min(ereq.prompt_token_ids) < 0 or max(ereq.prompt_token_ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
            )
        sp = ereq.sampling
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {n} tokens (at least one must be left for the output)"
            )
        if n + sp.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt ({n} tokens) plus max_tokens ({sp.max_tokens}) exceed it",
                param="max_tokens",
            )
        capacity = self.block_manager.num_blocks * BLOCK_SIZE
        if n + sp.max_tokens > capacity:
            # NOTE(kv-capacity): a request that cannot fit the whole KV cache alone
            # would wait forever; reject it up front.
            raise ContextLengthError(
                f"the KV cache holds {capacity} tokens; the prompt ({n} tokens) plus max_tokens "
                f"({sp.max_tokens}) exceed it (raise --kv-cache-memory)",
                param="max_tokens",
            )
        if ereq.priority not in (0, 1, 2):
            raise InvalidRequestError(f"invalid priority {ereq.priority}: expected 0, 1 or 2", param="priority")
        req = Request.from_engine_request(ereq)
        self.requests[rid] = req
        if sp.seed is not None:
            self.generators[rid] = torch.Generator().manual_seed(sp.seed % (2**64))
        self.scheduler.add_request(req)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Mark requests aborted; their blocks are freed at the start of the next step."""
        for rid in request_ids:
            if rid in self.requests:
                self._aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------ the step

    def step(self) -> list[EngineOutput]:
        t0 = time.monotonic()
        outputs = self._process_aborts()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        now = time.monotonic()
        rows: list[SamplingRow] = []
        for s in sched.scheduled:
            req = s.request
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = now
            if s.samples:
                rows.append(self._sampling_row(req))
        tokens, logprobs = self.runner.execute(sched, rows)
        self.scheduler.update_after_step(sched)
        now = time.monotonic()
        i = 0
        for s in sched.scheduled:
            if not s.samples:
                continue
            req = s.request
            tok, lp = tokens[i], logprobs[i]
            i += 1
            req.token_ids.append(tok)
            if req.timings.first_token is None:
                req.timings.first_token = now
            status = self._check_stop(req, tok)
            out = EngineOutput(
                request_id=req.request_id,
                new_token_ids=[tok],
                logprobs=[lp] if lp is not None else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=max(0, req.num_cached_tokens),
                num_generated_tokens=req.num_output_tokens,
                num_preemptions=req.num_preemptions,
            )
            if req.num_output_tokens == 1:
                out.timings = req.timings
            if status is not None:
                req.timings.finished = now
                self.scheduler.finish_request(req, status)
                del self.requests[req.request_id]
                self.generators.pop(req.request_id, None)
                out.finished = True
                out.finish_reason = status.finish_reason
                out.stop_token_id = req.stop_token_id
                out.timings = req.timings
            outputs.append(out)
        self._num_steps += 1
        self._last_batched = sched.num_batched_tokens
        self._last_step_time = time.monotonic() - t0
        return outputs

    def _sampling_row(self, req: Request) -> SamplingRow:
        sp = req.sampling
        banned: list[int] = []
        if req.num_output_tokens < sp.min_tokens:
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.eos_token_ids))
        return SamplingRow(sp, req.token_ids, req.num_prompt_tokens, self.generators.get(req.request_id), banned)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling
        n_out = req.num_output_tokens
        is_stop = (not sp.ignore_eos and tok in self.eos_token_ids) or tok in sp.stop_token_ids
        if n_out >= sp.min_tokens and is_stop:
            req.stop_token_id = tok
            return RequestStatus.FINISHED_STOPPED
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _process_aborts(self) -> list[EngineOutput]:
        outs = []
        for rid in self._aborted:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.generators.pop(rid, None)
            req.timings.finished = time.monotonic()
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            outs.append(
                EngineOutput(
                    request_id=rid,
                    new_token_ids=[],
                    finished=True,
                    finish_reason=FinishReason.ABORT,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(0, req.num_cached_tokens),
                    num_generated_tokens=req.num_output_tokens,
                    num_preemptions=req.num_preemptions,
                    timings=req.timings,
                )
            )
        self._aborted.clear()
        return outs

    # ------------------------------------------------------------ stats

    def make_stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        running = [0, 0, 0]
        for r in sch.running:
            running[r.priority] += 1
        return EngineStats(
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            num_running_by_priority=running,
            num_waiting_by_priority=sch.waiting.count_by_priority(),
            kv_cache_usage=bm.usage,
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            num_preemptions=sch.num_preemptions,
            num_steps=self._num_steps,
            step_time=self._last_step_time,
            num_batched_tokens=self._last_batched,
        )
