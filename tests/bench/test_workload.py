"""Workload generators: reproducible for a seed, distributions with the asked means."""

from __future__ import annotations

import json
import statistics
from itertools import islice

import pytest

from sluice.bench.workload import (
    Api,
    WorkloadSpec,
    generate_requests,
    load_trace,
    parse_length,
    parse_priority_mix,
    workload_from_dict,
)
from sluice.types import Priority


def take(spec: WorkloadSpec, n: int, seed: int = 0) -> list:
    return list(islice(generate_requests(spec, seed), n))


def test_same_seed_gives_identical_requests_and_another_seed_differs():
    spec = WorkloadSpec(
        input_len=parse_length("lognormal:100,0.5"),
        output_len=parse_length("uniform:10,50"),
        priority_mix=parse_priority_mix("p0=0.2,p1=0.5,p2=0.3"),
        prefix_groups=3,
        prefix_len=20,
    )
    a, b, c = take(spec, 200), take(spec, 200), take(spec, 200, seed=1)
    assert a == b, "the same seed must replay the same workload, or runs are not comparable"
    assert a != c, "a different seed must give a different workload"


@pytest.mark.parametrize(
    "text, mean",
    [("fixed:64", 64), ("uniform:10,90", 50), ("normal:200,20", 200), ("lognormal:300,0.6", 300)],
)
def test_length_distributions_have_the_asked_mean(text, mean):
    spec = WorkloadSpec(input_len=parse_length(text), output_len=parse_length(text))
    reqs = take(spec, 6000)
    got_in = statistics.fmean(r.num_prompt_tokens for r in reqs)
    got_out = statistics.fmean(r.max_tokens for r in reqs)
    assert got_in == pytest.approx(mean, rel=0.04), f"{text}: mean input length {got_in}"
    assert got_out == pytest.approx(mean, rel=0.04), f"{text}: mean output length {got_out}"
    # prompts are built from one-token words, so their word count is the length asked
    assert all(len(r.prompt.split()) == r.num_prompt_tokens for r in reqs[:50])


def test_priority_mix_fractions_are_respected():
    mix = parse_priority_mix("p0=1,p1=2,p2=1")  # normalised to 0.25/0.5/0.25
    assert mix == {Priority.P0: 0.25, Priority.P1: 0.5, Priority.P2: 0.25}
    reqs = take(WorkloadSpec(priority_mix=mix), 8000)
    frac = sum(r.priority is Priority.P0 for r in reqs) / len(reqs)
    assert frac == pytest.approx(0.25, abs=0.02), "p0 share should follow the mix"


def test_shared_prefix_groups_repeat_one_system_prompt_each():
    spec = WorkloadSpec(prefix_groups=4, prefix_len=50, input_len=parse_length(10))
    reqs = take(spec, 100)
    heads: dict[int, set[str]] = {}
    for r in reqs:
        assert r.prefix_group is not None and r.num_prompt_tokens == 60
        heads.setdefault(r.prefix_group, set()).add(r.prompt.split("\n\n")[0])
    assert len(heads) == 4, "every group should be used"
    assert all(len(h) == 1 for h in heads.values()), "a group's requests must share one prefix"
    assert len({next(iter(h)) for h in heads.values()}) == 4, "groups must differ from each other"


def test_trace_replay_keeps_lengths_times_and_priorities(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 100.0, "prompt_len": 12, "max_tokens": 5},
        {"timestamp": 100.5, "prompt": "hello there world", "max_tokens": 7, "priority": "p0"},
        {"timestamp": 102.0, "input_len": 3, "output_len": 2},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = list(generate_requests(WorkloadSpec(trace=load_trace(p)), 0))
    assert [r.send_at_s for r in reqs] == [0.0, 0.5, 2.0], "times count from the first entry"
    assert [r.num_prompt_tokens for r in reqs] == [12, 3, 3]
    assert [r.max_tokens for r in reqs] == [5, 7, 2]
    assert reqs[1].prompt == "hello there world" and reqs[1].priority is Priority.P0


def test_bad_trace_line_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt_len": 3, "max_tokens": 2}\n{"max_tokens": 2}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*prompt"):
        load_trace(p)


@pytest.mark.parametrize(
    "text", ["", "zipf:3", "uniform:5", "uniform:9,3", "normal:a,b", "fixed:0", "lognormal:10,-1"]
)
def test_bad_length_specs_are_rejected_readably(text):
    with pytest.raises(ValueError, match="invalid length"):
        parse_length(text)


def test_workload_yaml_mapping_is_validated():
    kw = workload_from_dict(
        {"api": "completions", "input_len": {"dist": "normal", "mean": 50, "std": 5},
         "output_len": 8, "priority_mix": {"p0": 1}}
    )  # fmt: skip
    spec = WorkloadSpec(**kw)
    assert spec.api is Api.COMPLETIONS and spec.output_len.mean == 8
    assert spec.priority_mix == {Priority.P0: 1.0}
    with pytest.raises(ValueError, match="unknown workload key"):
        workload_from_dict({"inptu_len": 5})
