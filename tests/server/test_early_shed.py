"""NOTE(early-shed): a request that admission refuses whatever its body says is answered 429 before the app
parses it; anything else goes the full path."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sluice.errors import OverloadedError
from sluice.server import admission as admission_mod
from sluice.server.early_shed import SPECIAL_TOKENS, ChatBound, prompt_bound
from sluice.server.testing import FakeCodec
from sluice.types import Priority
from tests.server.slo_fakes import FakeClock, controller, stats


def test_the_prompt_bound_counts_bytes_of_text_token_ids_and_choices() -> None:
    assert prompt_bound(b'{"prompt": "abc", "max_tokens": 16}') == 3 + SPECIAL_TOKENS
    assert prompt_bound('{"prompt": "é"}'.encode()) == 2 + SPECIAL_TOKENS, "UTF-8 bytes: a token is at least one"
    assert prompt_bound(b'{"prompt": ["ab", "cde"], "n": 2}') == 2 * (5 + 2 * SPECIAL_TOKENS)
    assert prompt_bound(b'{"prompt": [1, 2, 3]}') == 3 and prompt_bound(b'{"prompt": [[1, 2], [3]]}') == 3
    assert prompt_bound(b"not json") is None and prompt_bound(b'{"prompt": 5}') is None


class _CountingCodec(FakeCodec):
    """The fake byte codec; its template wraps each message and adds a system prompt when there is none."""

    def __init__(self) -> None:
        self.renders = 0

    def apply_chat_template(self, messages: list[dict[str, object]], add_generation_prompt: bool = True) -> str:
        self.renders += 1
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this template has no tool role")
        head = "" if messages[0]["role"] == "system" else "<s>system: You are helpful.</s>"
        return head + "".join(f"<s>{m['role']}: {m['content']}</s>" for m in messages) + ("<a>" if add_generation_prompt else "")


def test_the_chat_bound_is_the_templates_own_tokens_plus_the_contents_bytes() -> None:
    import json

    codec, cb = _CountingCodec(), ChatBound()
    convos = [[{"role": "user", "content": "héllo there"}],
              [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
              [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, {"role": "user", "content": "b" * 50}]]  # fmt: skip
    for msgs in convos:
        text_msgs = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                      "".join(p["text"] for p in m["content"] or [])} for m in msgs]  # fmt: skip
        real = len(codec.encode(codec.apply_chat_template(text_msgs), add_special_tokens=False))
        bound = cb.bound(json.dumps({"messages": msgs}).encode(), codec)
        assert bound is not None and real <= bound <= real + ChatBound.JOIN_SLACK * len(msgs), (real, bound)
        assert cb.bound(json.dumps({"messages": msgs, "n": 3}).encode(), codec) == 3 * bound
    renders = codec.renders
    assert cb.bound(json.dumps({"messages": [{"role": "user", "content": "other words"}]}).encode(), codec)
    assert codec.renders == renders, "one render per sequence of roles"
    assert cb.bound(json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(), codec) is None, (
        "a template that refuses the roles: the full path answers")
    assert cb.bound(b'{"messages": []}', codec) is None and cb.bound(b"{", codec) is None


def _refused_p1(clock: FakeClock, slo: str, backlog: int, num_p0_running: int = 0) -> admission_mod.AdmissionController:
    a = controller(slo, clock)
    a.observe_stats(stats(num_waiting_by_priority=[0, 3, 0], num_prefill_tokens_by_priority=[0, backlog, 0],
                          num_running_by_priority=[num_p0_running, 0, 0]))  # fmt: skip
    with pytest.raises(OverloadedError):  # behind the P1 backlog: over P1's target
        a.admit("p1", Priority.P1, 116, 100)
    return a


def test_a_class_refused_for_its_wait_is_refused_early_by_its_one_token_best_case_less_the_time_since() -> None:
    probe = controller("p0=1s,p2=100s", FakeClock())
    probe.observe_stats(stats(num_waiting_by_priority=[0, 3, 0], num_prefill_tokens_by_priority=[0, 300, 0]))
    floor = probe.predict(probe.load(), Priority.P1, 1)  # nothing queued below P1 to shed: the best case
    clock = FakeClock()
    a = _refused_p1(clock, f"p0=1s,p1={floor - 0.1:.4f}s,p2=100s", 300)  # the floor is 0.1 s over P1's target
    e = a.refuse_early(Priority.P1, 10)
    assert e is not None and e.code == "slo_unattainable" and e.retry_after is not None and e.retry_after >= 1.0
    assert a.refuse_early(Priority.P1) is None, "with no bound on its prompt a P1 is parsed"
    assert a.refuse_early(Priority.P0, 10) is None, "P0 is never refused early"
    assert a.refuse_early(Priority.P2) is not None, "NOTE(refused-above): any P2 while P1 is refused"
    clock.now += 0.09
    assert a.refuse_early(Priority.P1, 10) is not None
    clock.now += 0.02
    assert a.refuse_early(Priority.P1, 10) is None, "the floor less the 0.11 s since is within the target"
    assert a.refuse_early(Priority.P2) is not None, "P2 still follows P1's refusal for REFUSED_ABOVE_S"


def test_the_early_floor_lasts_early_shed_s_and_yields_to_a_longer_prompts_target() -> None:
    clock = FakeClock()
    a = _refused_p1(clock, "p0=1s,p1=0.2s,p2=100s", 3000)  # far over its target
    assert a.refuse_early(Priority.P1, 10) is not None
    clock.now += admission_mod.EARLY_SHED_S
    assert a.refuse_early(Priority.P1, 10) is None, "stale: the next P1 goes the full path and refreshes it"
    # P1's target: max(2 s, 10 x its unloaded TTFT), derived: it binds beside a P0 (NOTE(lone-class))
    auto = _refused_p1(FakeClock(), "p0=1s,p2=100s", 3000, num_p0_running=1)
    assert auto.refuse_early(Priority.P1, 10) is not None
    assert auto.refuse_early(Priority.P1, 10**6) is None, "a prompt that long has a target past the floor"


def test_a_lone_class_refused_past_the_longest_wait_is_refused_early_against_that_wait() -> None:
    # NOTE(lone-class), NOTE(measured-ceiling): P1 alone, a derived target: refused only once its queue shows a
    # wait past max_queue_wait (90 s), whatever the model predicts
    clock = FakeClock()
    a = controller("auto", clock)
    a.observe_stats(stats(num_waiting_by_priority=[0, 3, 0], num_prefill_tokens_by_priority=[0, 100_000, 0]))
    a.admit("p1-old", Priority.P1, 116, 100)  # predicted ~100 s, admitted: nobody has waited yet
    clock.now += 95.0
    with pytest.raises(OverloadedError):
        a.admit("p1", Priority.P1, 116, 100)
    e = a.refuse_early(Priority.P1, 10)
    assert e is not None and e.code == "wait_too_long", "the floor is over the 90 s wait, not just the 2 s target"
    a.max_queue_wait = 10_000.0
    assert a.refuse_early(Priority.P1, 10) is None, "a floor within the longest wait is parsed and admitted"


async def test_the_server_sheds_early_only_what_the_full_path_would_refuse_and_counts_it(server_factory) -> None:
    # one slot, 0.1 s steps: a P1 behind a running 20-token P1 waits ~2 s, over its 0.3 s target
    srv = server_factory(step_delay=0.1, max_num_seqs=1, slo="p1=0.3s,p2=100s")
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:

        async def go(priority: str | None, body: object, **headers: str) -> httpx.Response:
            h = {"x-priority": priority} if priority else {}
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            return await c.post("/v1/completions", headers={**h, **headers}, **kw)

        running = asyncio.create_task(go("p1", {"prompt": "x", "max_tokens": 20}))
        deadline = time.monotonic() + 10
        while srv.state.client.stats.num_running_by_priority[1] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        full = await go("p1", {"prompt": "x", "max_tokens": 2})
        assert full.status_code == 429 and "over the p1 target" in full.text, "the full path refuses, by prediction"
        # what the full path would answer 400 is shed early: its body is not validated
        p2 = await go("p2", b"not json", **{"x-request-id": "early-1"})
        assert p2.status_code == 429 and p2.json()["error"]["code"] == "slo_unattainable"
        assert "p1 requests are being refused" in p2.json()["error"]["message"]
        assert int(p2.headers["retry-after"]) >= 1 and p2.headers["x-request-id"] == "early-1"
        p1 = await go("p1", {"prompt": "x", "max_tokens": -5})
        assert p1.status_code == 429 and "at least" in p1.json()["error"]["message"], "its own class's floor"
        # the full path still decides the rest
        assert (await go(None, b"not json")).status_code == 400, "no class header: parsed (the body may name one)"
        assert (await go("p0", b"not json")).status_code == 400, "P0 is never shed early"
        assert (await go("p1", b"not json")).status_code == 400, "a P1 body that does not parse has no bound"
        chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
                            headers={"x-priority": "p1"})  # fmt: skip
        assert chat.status_code == 429 and "at least" in chat.json()["error"]["message"], "a chat P1: its own floor"
        assert (await go("p9", b"not json")).status_code == 400, "no such class"
        assert (await go("p2", {"prompt": "x", "max_tokens": 1})).status_code == 429
        assert (await running).status_code == 200
        text = (await c.get("/metrics")).text
    assert 'sluice_admission_rejected_total{priority="p2",reason="slo_unattainable"} 2.0' in text
    assert 'sluice_admission_rejected_total{priority="p1",reason="slo_unattainable"} 3.0' in text
    assert 'sluice_requests_total{priority="p2",status="429"} 2.0' in text
    assert 'sluice_slo_requests_total{priority="p2"} 2.0' in text


async def test_a_key_that_does_not_authenticate_is_answered_401_not_shed(server_factory) -> None:
    srv = server_factory(step_delay=0.1, max_num_seqs=1, slo="p1=0.3s,p2=100s", api_key=["sk-test-key"])
    auth = {"authorization": "Bearer sk-test-key"}
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        running = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20},
                                             headers={"x-priority": "p1", **auth}))  # fmt: skip
        deadline = time.monotonic() + 10
        while srv.state.client.stats.num_running_by_priority[1] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        r = await c.post("/v1/completions", json={"prompt": "x"}, headers={"x-priority": "p1", **auth})
        assert r.status_code == 429
        bad = await c.post("/v1/completions", json={"prompt": "x"}, headers={"x-priority": "p2"})
        assert bad.status_code == 401, bad.text
        ok = await c.post("/v1/completions", content=b"{", headers={"x-priority": "p2", **auth})
        assert ok.status_code == 429, "the same request with its key is shed early"
        assert (await running).status_code == 200


def test_the_body_read_for_the_bound_is_given_to_the_app_again() -> None:
    from sluice.server.early_shed import _buffered

    async def run(limit: int) -> tuple[bytes | None, list[dict[str, object]]]:
        messages = [{"type": "http.request", "body": b"ab", "more_body": True},
                    {"type": "http.request", "body": b"cd", "more_body": True},
                    {"type": "http.request", "body": b"e", "more_body": False},
                    {"type": "http.disconnect"}]  # fmt: skip

        async def receive() -> dict[str, object]:
            return messages.pop(0)

        body, replay = await _buffered(receive, limit)
        return body, [await replay() for _ in range(4)]

    body, seen = asyncio.run(run(100))
    assert body == b"abcde" and [m.get("body") for m in seen] == [b"ab", b"cd", b"e", None]
    body, seen = asyncio.run(run(3))
    assert body is None, "over the limit: no bound, the full path answers it"
    assert [m.get("body") for m in seen] == [b"ab", b"cd", b"e", None], "what was read, then the rest"
