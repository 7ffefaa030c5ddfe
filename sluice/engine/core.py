"""The engine core: ``step()`` = schedule -> execute -> update.

Synchronous and single-threaded.  ``sluice serve`` runs it in its own process
behind ZeroMQ; ``sluice.LLM`` drives it in-process.  It knows no exporter: it
returns ``EngineOutput`` messages and ``make_stats()`` snapshots.

Each step's token budget and kind (normal, or an express step of P0 prefills)
come from its ``StepPlanner`` (``step_planner``), which owns the measured step
time; the scheduler picks the requests (``scheduler``), the runner computes them
(``model_runner``), and the scheduler applies the result.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import BLOCK_SIZE, MID_STEP_POLL_S, EngineConfig, ModelInfo
from sluice.engine.hybrid_blocks import HybridBlockManager
from sluice.engine.kv_tiers.connector import KVTierConnector
from sluice.engine.kv_tiers.factory import make_kv_tier
from sluice.engine.lora_manager import LoRAManager
from sluice.engine.model_runner import ModelRunner
from sluice.engine.protocol import (
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineStats,
    LoRALoadRecord,
    SamplingParams,
)
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampler import SamplingRow
from sluice.engine.scheduler import Scheduler, SchedulerOutput
from sluice.engine.spec.draft import DraftModel, draft_source
from sluice.engine.spec.proposer import make_proposer
from sluice.engine.spec.speculator import Speculator
from sluice.engine.spec_config import SpecMethod, SpeculativeConfig
from sluice.engine.step_model import StepTimeModel
from sluice.engine.step_planner import EXPRESS, NESTED, NORMAL, StepPlanner
from sluice.engine.structured import (
    GrammarCompiler,
    GrammarState,
    constraint_key,
    make_ll_tokenizer,
)
from sluice.engine.validation import validate_request
from sluice.errors import ConfigError, InvalidRequestError, ModelLoadError, SluiceError
from sluice.models.loader import ModelSource, resolve_model
from sluice.types import Priority

__all__ = ["EngineCore"]

log = logging.getLogger("sluice.engine")



class EngineCore:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        extra_eos_token_ids: Sequence[int] = (),  # e.g. the tokenizer's, when it knows more than the model
        clock: Callable[[], float] = time.monotonic,  # steps are timed and requests aged by it (tests: a virtual one)
        **overrides: Any,  # EngineConfig fields
    ):
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        config.validate()
        self.config = config
        self.source = resolve_model(config.model)
        self.runner = ModelRunner(config, self.source)
        cfg = self.runner.model_config
        self.eos_token_ids = _eos_ids(self.source, [*cfg.eos_token_ids, *extra_eos_token_ids])
        self.block_manager: BlockManager | HybridBlockManager
        if self.runner.window_layers:  # NOTE(hybrid-blocks): the sliding layers' own tables over the one pool
            self.block_manager = HybridBlockManager(self.runner.num_blocks, self.runner.num_window_groups,
                                                    cfg.sliding_window, BLOCK_SIZE, config.enable_prefix_caching)  # fmt: skip
        else:
            self.block_manager = BlockManager(self.runner.num_blocks, BLOCK_SIZE, config.enable_prefix_caching)
        self.lora = LoRAManager(self.runner.model, max_rank=config.max_lora_rank, max_loras=config.max_loras,
                                capacity=config.num_cpu_loras)  # fmt: skip
        for name, path in config.lora_module_paths.items():
            try:
                self.lora.register_now(name, path)
            except SluiceError as e:
                raise ConfigError(f"lora_modules: {name}={path}: {e.message}", setting="lora_modules") from None
        self.runner.lora_adapters = self.lora.resident
        self.kv_tiers: KVTierConnector | None = None
        tier = make_kv_tier(config, self.source, self.runner)
        if tier is not None:
            self.kv_tiers = KVTierConnector(tier, self.runner.kv_cache, self.block_manager)
            self.block_manager.track_new_blocks = True
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.scheduling_policy,
            max_model_len=self.runner.max_model_len,
            eos_token_ids=self.eos_token_ids,
            max_loras=config.max_loras,
            adapter_ready=self.lora.is_ready,
            kv_tiers=self.kv_tiers,
            clock=clock,
            sliding_window=self._freeing_window(),
        )
        self.generators: dict[str, torch.Generator] = {}  # request_id -> its own, when seeded
        self._pending_aborts: list[str] = []
        self._last_step_time = 0.0
        self._last_batched = 0
        self._last_budget = config.max_num_batched_tokens
        self.planner = StepPlanner(config, self.scheduler)  # each step's size and kind, the step time
        self._arrivals: Callable[[], None] | None = None  # NOTE(mid-step-express): set_arrivals()
        self._publish: Callable[[list[EngineOutput]], None] | None = None
        self._mid_step_time = 0.0  # seconds the step in flight spent in nested express steps
        self._last_poll = 0.0
        self._step_budget: int | None = None  # the step in flight's token budget
        self._grammars: GrammarCompiler | None = None  # built by the first constrained request (grammars)
        self._compiling: dict[str, Request] = {}  # request_id -> a waiting request whose grammar compiles
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(config.speculative_config)
            self.speculator = Speculator(spec, make_proposer(spec, self._load_draft), self.runner.max_model_len)
        summary = self.runner.model.summary()  # what /v1/models and doctor show of the model
        self.model_info = ModelInfo(
            name=self.source.name,
            path=str(self.source.path),
            max_model_len=self.runner.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=self.eos_token_ids,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=config.device,
            num_blocks=self._lone_request_blocks(),
            block_size=BLOCK_SIZE,
            attention_backend=self.runner.attention.name,
            quantization=self.runner.quantization,
            kernel_path=self.runner.kernel_path,
            architecture=summary["architecture"],
            num_parameters=summary["num_parameters"],
            num_active_parameters=summary["num_active_parameters"],
            weight_bytes=summary["weight_bytes"],
        )

    def _lone_request_blocks(self) -> int:
        """Blocks of context one request can hold alone (NOTE(kv-capacity) in validation): every block, less,
        in a hybrid pool, what its sliding tables hold at most during a step (its window and a full step)."""
        bm = self.block_manager
        if not isinstance(bm, HybridBlockManager):
            return bm.num_blocks
        return max(1, bm.num_blocks - bm.window_blocks(self.config.max_num_batched_tokens))

    def _freeing_window(self) -> int | None:
        """The window out of which the scheduler frees blocks (NOTE(window-blocks) in the block manager).

        NOTE(window-scope): where every layer slides, the request's blocks; where global layers are
        interleaved (gemma2/3), the sliding layers' own tables (NOTE(hybrid-blocks)), or nothing when they
        share the global layers' blocks (a KV disk tier, a draft model).  Where every layer slides, a draft
        model writes and reads the request's blocks from its own progress, which may lag the window
        (NOTE(draft-blocks)): none are freed while one drafts.
        """
        cfg, spec = self.runner.model_config, self.config.speculative_config
        if self.runner.window_layers:
            return cfg.sliding_window
        if not cfg.sliding_window or not all(cfg.is_sliding(i) for i in range(cfg.num_layers)):
            return None
        if spec is not None and SpeculativeConfig.from_dict(spec).method is SpecMethod.DRAFT_MODEL:
            return None
        return cfg.sliding_window

    # ------------------------------------------------------------ speculation

    def _load_draft(self, model: str) -> DraftModel:
        source, quantization = draft_source(model, self.source)
        return DraftModel(self.config, source, quantization, self.runner.num_blocks, self.runner.dtype,
                          self.runner.model_config.vocab_size)  # fmt: skip

    # ------------------------------------------------------------ requests

    def add_request(self, ereq: EngineRequest) -> None:
        rid = ereq.request_id
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}", param="request_id")
        validate_request(ereq.prompt_token_ids, ereq.sampling, self.model_info, ereq.priority)
        sp = ereq.sampling
        req = Request.from_engine_request(ereq, self.scheduler.clock)
        if req.lora_name is not None:
            self.lora.acquire(req)  # ModelNotFoundError for an unknown adapter; starts its load if needed
        if sp.structured is not None:
            key = constraint_key(sp.structured)  # InvalidRequestError for a malformed one; the rest compiles later
            self.grammars.submit(key)
            self.grammars.counters.num_requests += 1
            req.grammar = GrammarState(key, self.scheduler.clock(), self.config.jump_forward)
            self._compiling[rid] = req
        if sp.seed is not None:
            self.generators[rid] = torch.Generator().manual_seed(sp.seed % (2**64))
        elif self.speculator is not None and not sp.is_greedy:
            # NOTE(coupled-drafts) in engine.spec.proposer: a sampled request drafts with its own generator's
            # noise, so each gets one, seeded from the engine's
            seed = int(torch.randint(0, 2**62, (1,), generator=self.runner.sampler.generator))
            self.generators[rid] = torch.Generator().manual_seed(seed)
        self.scheduler.add_request(req)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests; their blocks are freed at the start of the next step."""
        self._pending_aborts.extend(rid for rid in request_ids if rid in self.scheduler.requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------ LoRA adapters

    def load_lora_adapter(self, name: str, path: str, traceparent: str | None = None) -> int:
        """Start loading an adapter off the step loop; its ``LoRALoadRecord`` (ticket) says how it went."""
        return self.lora.start_load(name, path, traceparent)

    def unload_lora_adapter(self, name: str) -> None:
        self.lora.unregister(name)

    def take_lora_loads(self) -> list[LoRALoadRecord]:
        self.lora.poll()  # an idle engine does not step: finished loads are installed here too
        return self.lora.take_records()

    def has_pending_lora_loads(self) -> bool:
        return self.lora.has_pending_loads

    def _fail_lora_waiters(self) -> list[EngineOutput]:
        """Requests waiting for an adapter whose load failed: finished with the load's error."""
        failed = self.lora.waiting_on_failed_load()
        if not failed:
            return []
        waiting = [r for r in self.scheduler.requests.values() if r.lora_id in failed and r.status is RequestStatus.WAITING]
        outputs = []
        for req in waiting:
            (out,) = self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
            out.error = EngineError.from_exception(ModelLoadError(failed[req.lora_id]))
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------ structured outputs

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (and mask computer), built at the first constrained request: its
        tokenizer (~1.3 s for SmolLM2's) is built on its thread, which that request waits for."""
        if self._grammars is None:
            cfg = self.config
            vocab = self.runner.model_config.vocab_size

            def make_tokenizer() -> Any:
                from sluice.models.tokenizer import load_tokenizer

                return make_ll_tokenizer(load_tokenizer(self.source).hf, self.eos_token_ids, vocab)

            self._grammars = GrammarCompiler(make_tokenizer, max_entries=cfg.structured_cache_size,
                                             max_bytes=cfg.structured_cache_memory, clock=self.scheduler.clock)  # fmt: skip
        return self._grammars

    def _start_grammars(self) -> list[EngineOutput]:
        """Waiting requests whose grammar compiled: ready to be scheduled; those whose compile failed or
        ran past ``structured_compile_timeout``: ended with the error (NOTE(grammar-wait) in the scheduler)."""
        if not self._compiling:
            return []
        outputs = []
        now = self.scheduler.clock()
        for rid, req in list(self._compiling.items()):
            g = req.grammar
            assert g is not None
            if rid not in self.scheduler.requests:  # aborted meanwhile
                del self._compiling[rid]
                continue
            entry = self.grammars.entry(g.key)
            if entry is None and now - g.started <= self.config.structured_compile_timeout:
                continue
            del self._compiling[rid]
            req.timings.grammar_ready = now  # the API process's "grammar" span: arrival -> here
            if entry is not None and entry.matcher is not None:
                g.start(entry.matcher, req.output_token_ids)
                self._jump_start(req)
                continue
            error = (f"compiling it took over {self.config.structured_compile_timeout:g}s (structured_compile_timeout)"
                     if entry is None else entry.error)  # fmt: skip
            self.grammars.counters.num_compile_errors += 1
            (out,) = self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            out.error = EngineError.from_exception(
                InvalidRequestError(f"invalid structured output constraint: {error}", param="structured_outputs"))
            outputs.append(out)
        return outputs

    def _jump_start(self, req: Request) -> None:
        """Tokens the grammar forces before anything is sampled: output tokens, prefilled with the prompt
        (NOTE(jump-forward) in the scheduler); at least one token is left to sample."""
        g = req.grammar
        if g is None or not g.jump_forward:
            return
        forced = g.forced()[: max(0, req.sampling.max_tokens - 1 - req.num_output_tokens)]
        if forced:
            g.accept_forced(forced)
            req.token_ids.extend(forced)
            self.scheduler.outputs.num_jump_forward_tokens += len(forced)

    # ------------------------------------------------------------ the step

    def set_arrivals(
        self, take_arrivals: Callable[[], None], publish: Callable[[list[EngineOutput]], None]
    ) -> None:
        """Let a step look for arrivals between its layers (NOTE(mid-step-express)).

        ``take_arrivals()`` adds what came in (``add_request``) without blocking;
        ``publish(outputs)`` sends a nested express step's outputs at once.  The
        engine core process sets both; without them a P0 waits for the step in flight.
        """
        self._arrivals, self._publish = take_arrivals, publish
        self.planner.has_arrivals = True

    def step(self) -> list[EngineOutput]:
        t0 = self.scheduler.clock()
        outputs = self.scheduler.finish_requests(self._pending_aborts, RequestStatus.FINISHED_ABORTED)
        self._pending_aborts.clear()
        self.lora.poll()  # NOTE(lora-loads) in lora_manager: install finished loads, start queued ones
        outputs += self._fail_lora_waiters()
        outputs += self._start_grammars()
        target = self.scheduler.tightest_ttft_target()  # NOTE(target-memory): one look a step
        planner = self.planner
        self.scheduler.row_cap = planner.row_cap(target)
        budget = planner.token_budget(target)
        express = planner.is_express(budget)
        if self.speculator is not None:  # NOTE(adaptive-k): drafts per running decode (an express step takes none)
            self.speculator.plan(self.scheduler, self.step_model)
        sched = self.scheduler.schedule(planner.express_budget(budget) if express else budget, express)
        if express and sched.is_empty:  # the P0s could not start (no slot, no blocks): a normal step instead
            express = False
            sched = self.scheduler.schedule(budget)
        if not sched.is_empty:
            self._mid_step_time, self._step_budget = 0.0, budget
            outputs += self._run(sched, self._mid_step if planner.mid_step and not express else None)
            self._last_batched = sched.num_batched_tokens
            self._last_budget = self.config.max_num_batched_tokens if budget is None else budget  # a normal step's
            t1 = self.scheduler.clock()
            if self._mid_step_time:  # the step's own time: the nested steps were observed on their own
                t0 += self._mid_step_time
            self._last_step_time = t1 - t0
            planner.observe_step(sched.num_batched_tokens, len(sched.scheduled), t0, t1)
            planner.count_step(EXPRESS if express else NORMAL, t1 - t0, sched.num_batched_tokens)
        elif self.kv_tiers is not None and self.scheduler.loading:
            self.kv_tiers.wait_any(0.005)  # only loads in flight: wait for one instead of spinning
        elif self.lora.has_pending_loads:
            self.lora.wait_any(0.005)  # only adapter loads to wait for: sleep on them instead of spinning
        elif self._compiling:
            self.grammars.wait_any(0.005)  # only grammars compiling: the same
        self._release_finished(outputs)
        return outputs

    def _run(self, sched: SchedulerOutput, between_layers: Callable[[int], bool] | None = None) -> list[EngineOutput]:
        """Execute a planned step and apply it: the scheduler's outputs, the KV tier's new blocks."""
        spec = self.speculator
        if spec is not None:
            spec.propose(sched, self.generators)  # the drafts of the decodes given draft slots
        rows = self._sampling_rows(sched)
        tokens, logprobs = self.runner.execute(sched, rows, between_layers)
        runs = None
        if spec is not None:
            tokens, logprobs, runs = spec.verify(sched, tokens, logprobs, rows, self.generators)
            spec.observe(sched, runs)
        outputs = self.scheduler.update_from_output(sched, tokens, logprobs, runs)
        if self.kv_tiers is not None:  # NOTE(write-through) in kv_tiers.connector
            self.kv_tiers.store_new(self.block_manager.take_newly_cached())
        return outputs

    def _release_finished(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.generators.pop(out.request_id, None)
                self.lora.release(out.request_id)
                if self.speculator is not None:
                    self.speculator.forget([out.request_id])

    @property
    def step_model(self) -> StepTimeModel:
        """The measured step time (the planner's; the speculator's adaptive k reads it too)."""
        return self.planner.step_model

    @step_model.setter
    def step_model(self, model: StepTimeModel) -> None:
        self.planner.step_model = model

    @property
    def num_express_steps(self) -> int:
        """Express steps run, at step boundaries and nested (NOTE(express-step))."""
        return self.planner.num_express_steps

    @property
    def num_mid_step_express(self) -> int:
        """Express steps run between two layers of another step (NOTE(mid-step-express))."""
        return self.planner.num_mid_step_express

    def _mid_step(self, layer: int) -> bool:
        """Between two layers of a normal step: start waiting P0s now, in an express step of their own.

        NOTE(mid-step-express): a P0 arriving while a step runs would wait for
        the rest of that step (up to a third of its target at step boundaries only, NOTE(step-cap)) and
        then for its express step.  The step in flight looks for arrivals between
        its layers (at most every ``MID_STEP_POLL_S``); waiting P0s get a step
        of their own that runs here, nested: the scheduler plans it from free slots and free blocks
        only (nothing in flight is touched), its first tokens are published at
        once, and the outer step then goes on from the next layer.  Both steps'
        K/V live in disjoint blocks; their outputs are what they would be apart.
        Unlike at a step boundary, the express step is taken whatever a normal
        step would cost (only the share of express time bounds it): the
        alternative is the rest of the running step, then a normal one.
        Returns True when a step ran (the runner then sets its metadata again).
        """
        now = self.scheduler.clock()
        if now - self._last_poll < MID_STEP_POLL_S:
            return False
        self._last_poll = now
        assert self._arrivals is not None and self._publish is not None
        self._arrivals()
        budget = self._step_budget
        if self.scheduler.waiting.head(Priority.P0) is None or not self.planner.express_share_left():
            return False
        sched = self.scheduler.schedule(self.planner.express_budget(budget), nested=True)
        if sched.is_empty:
            return False
        t0 = self.scheduler.clock()
        outputs = self._run(sched)
        t1 = self.scheduler.clock()
        self.step_model.observe(sched.num_batched_tokens, t1 - t0, len(sched.scheduled))
        self._mid_step_time += t1 - t0
        self.planner.count_step(NESTED, t1 - t0, sched.num_batched_tokens)
        self._release_finished(outputs)
        self._publish(outputs)
        return True

    def _sampling_rows(self, sched: SchedulerOutput) -> list[SamplingRow]:
        rows = []
        constrained: list[tuple[SamplingRow, GrammarState]] = []
        for s in sched.scheduled:
            if not s.samples:
                continue
            req, sp = s.request, s.request.sampling
            banned: list[int] = []
            if req.num_output_tokens < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.eos_token_ids))
            gen = self.generators.get(req.request_id)
            if s.num_spec and self.speculator is not None:  # one row per position (NOTE(coupled-verification))
                def make_row(ids: list[int], n_out: int, sp: SamplingParams = sp, gen: torch.Generator | None = gen) -> SamplingRow:
                    ban = [] if n_out >= sp.min_tokens else list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.eos_token_ids))
                    return SamplingRow(sp, ids, len(ids) - n_out, gen, ban)

                spec_rows = self.speculator.rows(s, make_row)
                rows.extend(spec_rows)
                if req.grammar is not None:  # NOTE(spec-grammar): each position masked by its own state
                    constrained.extend(zip(spec_rows, self.speculator.grammar_states(s)))
                continue
            row = SamplingRow(sp, req.token_ids, req.num_prompt_tokens, gen, banned)
            rows.append(row)
            if req.grammar is not None:
                if req.grammar.num_accepted != req.num_output_tokens:  # never, unless a path forgot to feed it
                    req.grammar.sync(req.output_token_ids)
                constrained.append((row, req.grammar))
        if constrained:  # NOTE(mask-overlap) in structured: computed while the model runs
            masks = self.grammars.start_masks([g for _, g in constrained], self.runner.model_config.vocab_size)
            for j, (row, _) in enumerate(constrained):
                row.mask_bias = functools.partial(masks.row, j)
        return rows

    # ------------------------------------------------------------ KV tiers

    def kv_checkpoint(self) -> dict[str, Any]:
        """Write every cached prefix block the disk tier lacks, now (``POST /admin/kv/checkpoint``)."""
        if self.kv_tiers is None:
            return {"enabled": False, "reason": "no KV tier configured (--kv-disk-dir)"}
        return {"enabled": True, **self.kv_tiers.checkpoint()}

    def close(self, checkpoint: bool = True) -> None:
        """Stop the KV tier's threads; with ``checkpoint``, write what it lacks first (graceful stop)."""
        if self.kv_tiers is not None:
            self.kv_tiers.close(checkpoint=checkpoint)
            self.kv_tiers = None
            self.scheduler.kv_tiers = None
        if self._grammars is not None:
            self._grammars.close()

    # ------------------------------------------------------------ stats

    def make_stats(self) -> EngineStats:
        bm, sch, planner = self.block_manager, self.scheduler, self.planner
        pool = self.runner.pool_waits()
        running = [0, 0, 0]
        prefill_tokens = [0, 0, 0]
        decoding = [0, 0, 0]
        for r in sch.running:
            running[r.priority] += 1
            if r.is_prefill_done:
                decoding[r.priority] += 1
            else:
                prefill_tokens[r.priority] += r.num_tokens - r.num_computed_tokens
        for r in sch.waiting:
            prefill_tokens[r.priority] += r.num_tokens
        return EngineStats(
            num_running=len(sch.running),
            num_waiting=len(sch.waiting) + len(sch.loading),
            num_running_by_priority=running,
            num_waiting_by_priority=sch.waiting.count_by_priority(),
            kv_cache_usage=bm.usage,
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            num_preemptions=sch.num_preemptions,
            num_steps=planner.num_steps,
            step_time=self._last_step_time,
            num_batched_tokens=self._last_batched,
            num_batched_tokens_total=sum(planner.tokens_by_kind),  # every step's, nested ones too
            busy_seconds_by_kind=list(planner.busy_by_kind),
            batched_tokens_by_kind=list(planner.tokens_by_kind),
            steps_by_kind=list(planner.steps_by_kind),
            pool_wait_seconds=pool.wait_seconds,
            pool_stalls=pool.stalls,
            pool_stall_seconds=pool.stall_seconds,
            num_decoding=sum(decoding),
            num_decoding_by_priority=decoding,
            num_prefill_tokens_by_priority=prefill_tokens,
            step_time_base=self.step_model.base,
            step_time_per_token=self.step_model.per_token,
            step_time_per_seq=self.step_model.per_seq,
            max_num_batched_tokens=self._last_budget,
            express_budget=planner.express_budget(self._last_budget) if self.config.express_steps else 0,
            express_mid_step=planner.mid_step,
            max_num_seqs=sch.max_num_seqs,
            seq_limit_by_priority=[sch.seq_limit_for(p) for p in range(3)],
            running_slots=[[r.priority, r.num_output_tokens, max(1, r.sampling.max_tokens - r.num_output_tokens)]
                           for r in (*sch.running, *sch.loading)],  # fmt: skip
            lora=self.lora.make_stats(
                {r.lora_id for r in sch.running if r.lora_id},
                sum(1 for r in sch.waiting if r.lora_id and not self.lora.is_ready(r)),
            ),
            kv_cache_dtype=self.runner.kv_format.name,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            num_cached_blocks=len(bm.block_by_hash),
            num_loading=len(sch.loading),
            kv_tiers=[self.kv_tiers.make_stats()] if self.kv_tiers is not None else [],
            **self._structured_stats(),
            **(self.speculator.make_stats() if self.speculator is not None else {}),
        )

    def _structured_stats(self) -> dict[str, Any]:
        if self._grammars is None:
            return {}
        c, sch = self._grammars.counters, self.scheduler
        return dict(
            structured_requests=c.num_requests,
            structured_waiting_for_compile=len(self._compiling),
            structured_compiles=c.num_compiles,
            structured_compile_errors=c.num_compile_errors,
            structured_cache_hits=c.num_cache_hits,
            structured_compile_seconds=c.compile_seconds,
            structured_compile_buckets=list(c.compile_buckets),
            structured_cache_entries=self._grammars.num_entries,
            structured_cache_bytes=self._grammars.num_bytes,
            structured_mask_steps=c.num_mask_steps,
            structured_mask_seconds=c.mask_seconds,
            structured_mask_wait_seconds=c.mask_wait_seconds,
            structured_mask_buckets=list(c.mask_buckets),
            structured_tokens=sch.outputs.num_structured_tokens,
            jump_forward_tokens=sch.outputs.num_jump_forward_tokens,
        )


def _eos_ids(source: ModelSource, known: Iterable[int]) -> tuple[int, ...]:
    """The model's EOS ids, plus those of an HF folder's generation_config.json."""
    ids = set(known)
    gen_cfg = source.path / "generation_config.json" if source.kind == "hf" else None
    if gen_cfg is not None and gen_cfg.is_file():
        e = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return tuple(sorted(int(i) for i in ids))
