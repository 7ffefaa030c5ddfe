"""Structured outputs in the engine (sluice.engine.structured): constrained answers validate, in any
batch, through preemption and jump-forward; a compile never blocks the step loop, and a bad one ends
only its own request.  Tiny random model, real llguidance."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice import LLM
from sluice.engine.core import EngineCore
from sluice.engine.protocol import EngineOutput, EngineRequest, SamplingParams, StructuredOutputs
from sluice.engine.structured import JSON_OPTIONS
from sluice.errors import InvalidRequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Give me a person:", "JSON please", "a b c d e f", "Once upon a time there was"]


def _json(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 96, "temperature": 0.0, **kw}, structured=StructuredOutputs(json=json.dumps(schema)))


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def llm_no_jf(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), kv_cache_memory=8 << 20, jump_forward=False)


def _valid(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_schema_answers_validate_and_end_with_stop(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, _json(PERSON))
    for o in outs:
        assert o.finish_reason == "stop", f"a complete object ends the request with stop: {o.text!r}"
        _valid(o.text, PERSON)
    st_ = llm.engine.make_stats()
    assert st_.structured_requests >= 4 and st_.structured_compiles >= 1 and st_.structured_cache_hits >= 3
    assert st_.structured_mask_steps > 0 and st_.jump_forward_tokens > 0 and st_.structured_tokens > 0
    assert sum(st_.structured_compile_buckets) == st_.structured_compiles


def test_choice_regex_grammar_and_json_object(llm: LLM) -> None:
    so = [StructuredOutputs(choice=["yes", "no", "maybe so"]), StructuredOutputs(regex=r"[a-c]{2,4}-[0-9]{3}"),
          StructuredOutputs(grammar='start: "call " fn "(" NUM ")"\nfn: "f" | "gg"\nNUM: /[0-9]{1,3}/'),
          StructuredOutputs(json_object=True)]  # fmt: skip
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured=s) for s in so]
    a, b, c, d = llm.generate(["Q:"] * 4, params)
    assert a.text in ("yes", "no", "maybe so") and a.finish_reason == "stop"
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", b.text), b.text
    assert re.fullmatch(r"call (f|gg)\([0-9]{1,3}\)", c.text), c.text
    if d.finish_reason == "stop":
        assert isinstance(json.loads(d.text), dict)
    else:
        assert d.text.startswith("{")


def test_lark_grammar_embedding_a_json_schema(llm: LLM) -> None:
    # a schema's "x-guidance" sets llguidance's JSON options: without them %json allows any whitespace
    grammar = 'start: "<call>" obj "</call>"\nobj: %json ' + json.dumps({**PERSON, "x-guidance": JSON_OPTIONS})
    (o,) = llm.generate(["Q:"], SamplingParams(max_tokens=120, temperature=0.0, structured=StructuredOutputs(grammar=grammar)))
    assert o.finish_reason == "stop" and o.text.startswith("<call>") and o.text.endswith("</call>"), o.text
    _valid(o.text.removeprefix("<call>").removesuffix("</call>"), PERSON)


def test_constrained_requests_give_the_same_tokens_alone_and_in_mixed_batches(llm: LLM) -> None:
    greedy, seeded = _json(PERSON), _json(PERSON, temperature=1.0, seed=11, logprobs=2)
    alone = [llm.generate([PROMPTS[0]], p)[0] for p in (greedy, seeded)]
    free = SamplingParams(max_tokens=30, temperature=0.0)
    regex = SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredOutputs(regex="[0-9]+x"))
    batch = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[0], PROMPTS[1]], [free, greedy, regex, seeded, free])
    assert batch[1].token_ids == alone[0].token_ids, "greedy constrained tokens changed with the batch"
    assert batch[3].token_ids == alone[1].token_ids, "seeded constrained tokens changed with the batch"
    for x, y in zip(batch[3].outputs[0].logprobs or [], alone[1].outputs[0].logprobs or [], strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-5)


def test_jump_forward_appends_forced_tokens_and_changes_no_token(llm: LLM, llm_no_jf: LLM) -> None:
    before = llm.engine.make_stats()
    on = llm.generate(PROMPTS[:2], _json(PERSON, logprobs=1))
    mid = llm.engine.make_stats()
    off = llm_no_jf.generate(PROMPTS[:2], _json(PERSON, logprobs=1))
    after_off = llm_no_jf.engine.make_stats()
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids, "jump-forward must append the tokens decoding would have produced"
        assert a.finish_reason == b.finish_reason == "stop"
        lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert lp_a is not None and lp_b is not None and len(lp_a) == len(a.token_ids)
        for x, y in zip(lp_a, lp_b):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    forced = mid.jump_forward_tokens - before.jump_forward_tokens
    assert forced >= 2 * 5, "the schema's keys and punctuation are forced runs"
    assert after_off.jump_forward_tokens == 0
    steps_on, steps_off = mid.num_steps - before.num_steps, after_off.num_steps
    assert steps_on < steps_off, f"jump-forward saves decode steps ({steps_on} vs {steps_off})"


def test_max_tokens_and_stop_strings_still_cut_a_constrained_answer(llm: LLM) -> None:
    (cut,) = llm.generate([PROMPTS[0]], _json(PERSON, max_tokens=5))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5, "jump-forward respects max_tokens"
    (stopped,) = llm.generate([PROMPTS[0]], _json(PERSON, stop=['"age"']))
    assert stopped.finish_reason == "stop" and '"age"' not in stopped.text and stopped.text.startswith('{"name": "')


def test_a_grammar_completed_by_the_last_allowed_token_says_stop(llm_no_jf: LLM) -> None:
    (o,) = llm_no_jf.generate(["Q:"], SamplingParams(max_tokens=1, temperature=0.0, structured=StructuredOutputs(choice=["yes"])))
    assert (o.text, o.finish_reason) == ("yes", "stop"), "complete at max_tokens: the grammar's stop wins"


def test_n_completions_each_follow_the_grammar(llm: LLM) -> None:
    (o,) = llm.generate([PROMPTS[1]], _json(PERSON, n=3, temperature=1.0, seed=5))
    assert len(o.outputs) == 3
    for c in o.outputs:
        assert c.finish_reason == "stop"
        _valid(c.text, PERSON)


def test_preemption_mid_answer_keeps_it_valid_and_unchanged(tiny_llama: Path, llm: LLM) -> None:
    # 6 blocks of 16 tokens: four requests of ~60 tokens cannot all hold their blocks at once
    small = LLM(str(tiny_llama), kv_cache_memory=6 * 2 * 2 * 16 * 2 * 16 * 4, max_num_seqs=4)
    schema = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string", "minLength": 20, "maxLength": 24}}}
    params = _json(schema, max_tokens=80)
    outs = small.generate(PROMPTS, params)
    assert sum(o.num_preemptions for o in outs) > 0, "the KV budget was meant to force preemptions"
    want = llm.generate(PROMPTS, params)
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids, "a recomputed constrained request must produce the same tokens"
        if o.finish_reason == "stop":
            _valid(o.text, schema)


def test_prefix_cache_hit_gives_the_same_constrained_answer(llm: LLM) -> None:
    prompt = list(range(100, 140))
    (a,) = llm.generate([prompt], _json(PERSON))
    (b,) = llm.generate([prompt], _json(PERSON))
    assert b.num_cached_tokens >= 32 and a.token_ids == b.token_ids


# ------------------------------------------------------------ compile errors, slow compiles


def _drain(engine: EngineCore, limit_s: float = 30.0) -> dict[str, list[EngineOutput]]:
    by_id: dict[str, list[EngineOutput]] = {}
    t_end = time.monotonic() + limit_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < t_end, "the engine did not finish"
        for out in engine.step():
            by_id.setdefault(out.request_id, []).append(out)
    return by_id


def test_a_bad_grammar_ends_only_its_own_request(llm: LLM) -> None:
    engine = llm.engine
    good = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_request(EngineRequest(request_id="good", prompt_token_ids=[5, 6, 7], sampling=good))
    for rid, so in (("bad-regex", StructuredOutputs(regex="(")), ("bad-lark", StructuredOutputs(grammar="start: foo")),
                    ("bad-schema", StructuredOutputs(json='{"type": "foo"}'))):  # fmt: skip
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                                         sampling=SamplingParams(max_tokens=8, structured=so)))  # fmt: skip
    errors_before = engine.make_stats().structured_compile_errors
    outs = _drain(engine)
    for rid in ("bad-regex", "bad-lark", "bad-schema"):
        (last,) = outs[rid]
        assert last.finished and last.error is not None and last.new_token_ids == []
        assert last.error.type == "invalid_request_error" and last.error.param == "structured_outputs", last.error
    assert "foo" in outs["bad-lark"][0].error.message  # type: ignore[union-attr]
    assert outs["good"][-1].finish_reason == "length" and outs["good"][-1].error is None
    assert engine.make_stats().structured_compile_errors - errors_before == 3


def test_a_malformed_constraint_is_refused_at_once(llm: LLM) -> None:
    for so in (StructuredOutputs(json="{not json"), StructuredOutputs(choice=[])):
        with pytest.raises(InvalidRequestError):
            llm.engine.add_request(EngineRequest(request_id="m", prompt_token_ids=[1, 2], sampling=SamplingParams(structured=so)))
        assert not llm.engine.has_unfinished_requests()


def test_a_slow_compile_does_not_block_other_requests(tiny_llama: Path) -> None:
    engine = EngineCore(model=str(tiny_llama), kv_cache_memory=4 << 20, structured_compile_timeout=5.0)
    release = {"at": float("inf")}
    compile_fn = engine.grammars.compile_fn

    def slow(kind: str, spec: str, tokenizer: Any) -> Any:
        while time.monotonic() < release["at"]:
            time.sleep(0.01)
        return compile_fn(kind, spec, tokenizer)

    engine.grammars.compile_fn = slow
    engine.add_request(EngineRequest(request_id="slow", prompt_token_ids=[5, 6, 7],
                                     sampling=SamplingParams(max_tokens=4, temperature=0.0,
                                                             structured=StructuredOutputs(regex="[0-9]{4}"))))  # fmt: skip
    engine.add_request(EngineRequest(request_id="free", prompt_token_ids=[8, 9], sampling=SamplingParams(max_tokens=6)))
    done: dict[str, EngineOutput] = {}
    while "free" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "slow" not in done, "the constrained request waits for its grammar"
    stats = engine.make_stats()
    assert stats.structured_waiting_for_compile == 1 and stats.num_waiting == 1
    release["at"] = time.monotonic()
    outs = _drain(engine)
    assert outs["slow"][-1].finish_reason == "stop" and outs["slow"][-1].error is None  # four digits: complete
    t = outs["slow"][-1].timings
    assert t is not None and t.grammar_ready is not None and t.first_scheduled is not None
    assert t.arrival < release["at"] <= t.grammar_ready <= t.first_scheduled, "the grammar span ends when it compiled"
    assert done["free"].timings is not None and done["free"].timings.grammar_ready is None
    engine.close()


def test_a_compile_past_the_timeout_ends_the_request_with_an_error(tiny_llama: Path) -> None:
    engine = EngineCore(model=str(tiny_llama), kv_cache_memory=4 << 20, structured_compile_timeout=0.2)
    compile_fn = engine.grammars.compile_fn
    engine.grammars.compile_fn = lambda *a: (time.sleep(0.6), compile_fn(*a))[1]
    engine.grammars.tokenizer  # noqa: B018 -- built first: the timeout is about the compile
    engine.add_request(EngineRequest(request_id="t", prompt_token_ids=[5, 6], sampling=SamplingParams(
        structured=StructuredOutputs(regex="a+"))))  # fmt: skip
    (out,) = _drain(engine)["t"]
    assert out.error is not None and "structured_compile_timeout" in out.error.message
    engine.close()


def test_abort_while_compiling(tiny_llama: Path, llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(EngineRequest(request_id="ab", prompt_token_ids=[5, 6], sampling=SamplingParams(
        structured=StructuredOutputs(regex="never-compiled-before-[0-9]+"))))  # fmt: skip
    engine.abort(["ab"])
    (out,) = _drain(engine)["ab"]
    assert out.finished and out.finish_reason == "abort"
    assert engine.make_stats().structured_waiting_for_compile == 0


def test_the_grammar_cache_is_bounded_in_entries_and_bytes_and_counts_hits(llm: LLM) -> None:
    from sluice.engine.structured import GrammarCompiler

    tok = llm.engine.grammars.tokenizer

    def fill(compiler: GrammarCompiler, n: int) -> None:
        for i in range(n):
            key = ("regex", f"a{i}[0-9]+")
            compiler.submit(key)
            while compiler.entry(key) is None:
                time.sleep(0.001)

    by_entries = GrammarCompiler(lambda: tok, max_entries=3)
    fill(by_entries, 5)
    assert by_entries.num_entries == 3 and by_entries.counters.num_compiles == 5
    by_entries.submit(("regex", "a4[0-9]+"))  # the newest is still there
    by_entries.submit(("regex", "a0[0-9]+"))  # the oldest was evicted: compiled again
    assert by_entries.counters.num_cache_hits == 1
    by_bytes = GrammarCompiler(lambda: tok, max_bytes=1)
    fill(by_bytes, 3)
    assert by_bytes.num_entries == 1 and by_bytes.num_bytes > 1, "past the byte cap only the newest entry is kept"
    for c in (by_entries, by_bytes):
        c.close()


@pytest.mark.parametrize("extra", [64, 0, -100])
def test_the_mask_fits_an_lm_head_wider_or_narrower_than_the_tokenizer(llm: LLM, extra: int) -> None:
    import llguidance

    from sluice.engine.structured import (
        GrammarState,
        MaskBatch,
        StructuredCounters,
        compile_grammar,
        grammar_spec,
    )

    tok = llm.engine.grammars.tokenizer
    key = ("choice", json.dumps(["yes", "no"]))
    state = GrammarState(key, 0.0, True)
    state.start(compile_grammar("choice", grammar_spec(*key), tok), [])
    vocab = tok.vocab_size + extra
    bias = MaskBatch(None, llguidance.LLExecutor(1), [state], (tok.vocab_size + 31) // 32, vocab, StructuredCounters()).row(0)
    assert bias.shape == (vocab,) and bias.dtype == torch.float32
    allowed = (bias == 0).nonzero().flatten().tolist()
    assert allowed and all(t < min(vocab, tok.vocab_size) for t in allowed)
    assert {llm.tokenizer.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}
    assert bool(torch.isinf(bias[tok.vocab_size:]).all())


# ------------------------------------------------------------ property: random schemas


_LEAVES = st.sampled_from([
    {"type": "integer", "minimum": -50, "maximum": 500},
    {"type": "string", "maxLength": 6},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", 3]},
    {"type": "number", "minimum": 0, "maximum": 10},
])  # fmt: skip


def _objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    keys = st.lists(st.sampled_from(["id", "name", "value", "x", "items", "ok"]), min_size=1, max_size=3, unique=True)

    def build(ks: list[str], kids: list[dict], required: int) -> dict:
        props = dict(zip(ks, kids))
        return {"type": "object", "properties": props, "required": ks[:required], "additionalProperties": False}

    return keys.flatmap(lambda ks: st.builds(build, st.just(ks), st.lists(children, min_size=len(ks), max_size=len(ks)),
                                             st.integers(0, len(ks))))  # fmt: skip


SCHEMAS = st.recursive(
    _LEAVES,
    lambda kids: st.one_of(_objects(kids), kids.map(lambda k: {"type": "array", "items": k, "maxItems": 3})),
    max_leaves=5,
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_random_json_schemas_compile_and_every_answer_validates(llm: LLM, schema: dict, seed: int) -> None:
    outs = llm.generate(PROMPTS[:2], [_json(schema, max_tokens=160), _json(schema, max_tokens=160, temperature=1.0, seed=seed)])
    for o in outs:
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            _valid(o.text, schema)


def test_validate_constraint_refuses_what_the_engine_would_and_loads_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from sluice.engine.structured import validate_constraint; "
            "from sluice.engine.protocol import StructuredOutputs as S; "
            "validate_constraint(S(json='{\"type\": \"object\"}')); assert 'torch' not in sys.modules")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
    from sluice.engine.structured import validate_constraint

    for so in (StructuredOutputs(regex="("), StructuredOutputs(grammar="start: foo"), StructuredOutputs(json='{"type": "foo"}')):
        with pytest.raises(InvalidRequestError) as e:
            validate_constraint(so)
        assert e.value.param == "structured_outputs"
    validate_constraint(StructuredOutputs(grammar='start: "a" x\nx: %json {"type": "integer"}'))


@pytest.mark.slow
def test_smollm2_answers_follow_the_schema() -> None:
    llm = LLM("smollm2", max_num_seqs=8)
    convs = [[{"role": "user", "content": f"Describe {who} as a JSON object with name, age and tags."}]
             for who in ("a pirate", "a cat", "my grandmother")]  # fmt: skip
    for o in llm.chat(convs, _json(PERSON, max_tokens=80)):
        assert o.finish_reason == "stop", o.text
        _valid(o.text, PERSON)
    (o,) = llm.chat([{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                    SamplingParams(max_tokens=5, temperature=0.0, structured=StructuredOutputs(choice=["yes", "no"])))
    assert o.text in ("yes", "no") and o.finish_reason == "stop"


def test_constrained_requests_with_lora_adapters_priorities_and_the_disk_tier(tiny_llama: Path, tmp_path: Path) -> None:
    from lora_factory import make_lora_dir

    from sluice.models.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((tiny_llama / "config.json").read_text()))
    adapter = make_lora_dir(tmp_path / "qv", cfg, targets=("q_proj", "v_proj"), rank=8, seed=1, std=0.5)
    llm = LLM(str(tiny_llama), kv_cache_memory=8 << 20, lora_modules=[f"qv={adapter}"], kv_disk_dir=str(tmp_path / "kv"))
    prompt = llm.tokenizer.encode("Describe a person as a JSON object with a name, an age and some tags. " * 3)
    outs = llm.generate([prompt] * 3, _json(PERSON), lora=["qv", None, "qv"], priority=["p0", "p2", "p1"])
    for o in outs:
        assert o.finish_reason == "stop"
        _valid(o.text, PERSON)
    assert outs[0].token_ids == outs[2].token_ids and outs[0].token_ids != outs[1].token_ids, (
        "the adapter changes the answer, within the grammar")
    llm.engine.close()
