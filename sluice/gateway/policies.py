"""Routing policies: pick one replica among the routable candidates (pure).

Every policy has the same synchronous signature,
``choose(candidates, request) -> Decision``, and is built by ``make_policy``
from its ``PolicyName``.  Candidates are already filtered (healthy, breaker
closed or probing, not yet tried for this request) and never empty.  Policies
keep only small routing memory (round-robin cursors, the prefix index) and
take their randomness and time from injected ``rng`` / ``clock``.
"""

from __future__ import annotations

import abc
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluice.gateway.config import GatewayConfig, PolicyName, PrefixAffinityConfig, WeightedConfig
from sluice.gateway.replica import Replica

__all__ = [
    "RouteRequest",
    "Decision",
    "RoutingPolicy",
    "RoundRobinPolicy",
    "LeastLoadPolicy",
    "WeightedPolicy",
    "PrefixAffinityPolicy",
    "prefix_hashes",
    "dynamic_weight",
    "make_policy",
    "spread_p0",
]


@dataclass(frozen=True)
class RouteRequest:
    model: str
    prompt_text: str  # prompt, or chat messages flattened; "" when unknown
    num_tokens: int  # estimated prompt + max_tokens (the "outstanding tokens" unit)


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # metrics label: "rr", "least_load", "affinity", "miss", "balance", ...


class RoutingPolicy(abc.ABC):
    name: PolicyName

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision: ...


class _SmoothWRR:
    """nginx's smooth weighted round robin over a changing candidate set."""

    def __init__(self) -> None:
        self._current: dict[str, float] = {}  # replica url -> current weight

    def pick(self, candidates: Sequence[Replica], weights: Sequence[float]) -> Replica:
        total = sum(weights)
        best, best_w = candidates[0], float("-inf")
        for r, w in zip(candidates, weights, strict=False):
            cur = self._current.get(r.url, 0.0) + w
            self._current[r.url] = cur
            if cur > best_w:
                best, best_w = r, cur
        self._current[best.url] -= total
        return best


class RoundRobinPolicy(RoutingPolicy):
    name = PolicyName.ROUND_ROBIN

    def __init__(self) -> None:
        self._wrr = _SmoothWRR()

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        return Decision(self._wrr.pick(candidates, [r.weight for r in candidates]), "rr")


class LeastLoadPolicy(RoutingPolicy):
    """Fewest outstanding tokens (per unit of weight); ties broken by the power
    of two choices on pending requests, so equal replicas share evenly instead
    of the first one taking every burst."""

    name = PolicyName.LEAST_LOAD

    def __init__(self, rng: random.Random):
        self._rng = rng

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        loads = [r.inflight_tokens / r.weight for r in candidates]
        low = min(loads)
        tied = [r for r, load in zip(candidates, loads, strict=False) if load == low]
        if len(tied) == 1:
            return Decision(tied[0], "least_load")
        a, b = self._rng.sample(tied, 2)
        return Decision(b if b.num_pending < a.num_pending else a, "least_load_p2c")


def dynamic_weight(replica: Replica, config: WeightedConfig) -> float:
    """0.4 x CPU headroom + 0.3 x free memory + 0.3 x max(0.1, 1 - pending/capacity),
    times the replica's static weight.  Unexported host figures count as idle."""
    cpu_headroom = 1.0 - (replica.load.cpu_utilization or 0.0)
    free_memory = 1.0 - (replica.load.memory_used or 0.0)
    queue_room = max(0.1, 1.0 - replica.num_pending / replica.config.capacity)
    w = config.w_cpu * cpu_headroom + config.w_memory * free_memory + config.w_pending * queue_room
    return replica.weight * max(w, 1e-3)


class WeightedPolicy(RoutingPolicy):
    """Dynamic weighted round robin; weights recomputed every ``period_s``."""

    name = PolicyName.WEIGHTED

    def __init__(self, config: WeightedConfig, clock: Callable[[], float]):
        self.config = config
        self._clock = clock
        self._wrr = _SmoothWRR()
        self._weights: dict[str, float] = {}  # replica url -> dynamic weight
        self._computed_at = float("-inf")

    def weights(self, candidates: Sequence[Replica]) -> list[float]:
        now = self._clock()
        stale = now - self._computed_at >= self.config.period_s
        if stale or any(r.url not in self._weights for r in candidates):
            # NOTE(weighted-period): weights move only every period_s, so a
            # replica is not flooded and starved in turn between two scrapes.
            self._weights.update({r.url: dynamic_weight(r, self.config) for r in candidates})
            if stale:
                self._computed_at = now
        return [self._weights[r.url] for r in candidates]

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        return Decision(self._wrr.pick(candidates, self.weights(candidates)), "weighted")


def spread_p0(candidates: Sequence[Replica]) -> tuple[list[Replica], str | None]:
    """The candidates for a P0 request: those with the fewest P0s still waiting for an answer
    there, and the ``decisions`` reason when that left some out.

    NOTE(p0-spread): a replica serves the P0 prompts that reach it together, so a P0 sent
    where another one still waits for its first token waits behind that one's prefill: at 3x
    load such P0s missed their target far more often than those sent to a replica with none
    (the measurement: "P0s spread over the replicas" in `git show c2f0033:docs/benchmarks.md`).
    The count is the gateway's own (sent, no status or first byte yet; a
    request that does not stream has no first byte before its whole answer, so it counts
    until then, decode included: erring towards spreading); the
    usual policy then chooses among the replicas kept, so prefix affinity and load still
    decide between equals.  Only P0: the lower classes wait in the replicas' queues, where
    load-based routing already balances them.
    """
    fewest = min(r.p0_awaiting_first for r in candidates)
    kept = [r for r in candidates if r.p0_awaiting_first == fewest]
    return kept, ("p0_spread" if len(kept) < len(candidates) else None)


def prefix_hashes(text: str, chunk_chars: int, max_chunks: int) -> list[int]:
    """Chained hashes of the prompt's full ``chunk_chars`` chunks: hash i covers
    the whole prefix text[: (i + 1) * chunk_chars], like the engine's block hashes."""
    out: list[int] = []
    h = 0
    for i in range(min(len(text) // chunk_chars, max_chunks)):
        h = hash((h, text[i * chunk_chars : (i + 1) * chunk_chars]))
        out.append(h)
    return out


class PrefixAffinityPolicy(RoutingPolicy):
    """Send a request to the replica that served its longest known prefix.

    NOTE(prefix-affinity): the gateway cannot see the replicas' prefix caches;
    it remembers which replica it last sent each prefix chunk to (bounded LRU),
    which is where the engine's prefix cache most likely holds those blocks.
    When that replica is loaded beyond a bound relative to the least loaded
    candidate (pending > min + balance_abs and pending > balance_rel x min), or
    no prefix is known, the request goes to the fallback (least_load) and the
    prefix is re-homed there.
    """

    name = PolicyName.PREFIX_AFFINITY

    def __init__(self, config: PrefixAffinityConfig, fallback: RoutingPolicy):
        self.config = config
        self.fallback = fallback
        self._index: OrderedDict[int, str] = OrderedDict()  # prefix hash -> replica url

    def choose(self, candidates: Sequence[Replica], request: RouteRequest) -> Decision:
        c = self.config
        hashes = prefix_hashes(request.prompt_text, c.chunk_chars, c.max_chunks)
        by_url = {r.url: r for r in candidates}
        target: Replica | None = None
        for h in reversed(hashes):
            url = self._index.get(h)
            if url is not None and url in by_url:
                target = by_url[url]
                break
        if target is None:
            decision = Decision(self.fallback.choose(candidates, request).replica, "miss")
        else:
            low = min(r.num_pending for r in candidates)
            overloaded = (
                target.num_pending > low + c.balance_abs and target.num_pending > c.balance_rel * low
            )
            if overloaded:
                decision = Decision(self.fallback.choose(candidates, request).replica, "balance")
            else:
                decision = Decision(target, "affinity")
        self._remember(hashes, decision.replica.url)
        return decision

    def _remember(self, hashes: list[int], url: str) -> None:
        for h in hashes:
            self._index[h] = url
            self._index.move_to_end(h)
        while len(self._index) > self.config.max_entries:
            self._index.popitem(last=False)


def make_policy(
    name: PolicyName | str,
    config: GatewayConfig,
    *,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RoutingPolicy:
    """Build a policy by name (``--policy``); raises ValueError for unknown names."""
    try:
        name = PolicyName(name)
    except ValueError:
        known = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown routing policy {name!r}: expected one of {known}") from None
    rng = rng or random.Random(config.seed)
    if name is PolicyName.ROUND_ROBIN:
        return RoundRobinPolicy()
    if name is PolicyName.LEAST_LOAD:
        return LeastLoadPolicy(rng)
    if name is PolicyName.WEIGHTED:
        return WeightedPolicy(config.weighted, clock)
    return PrefixAffinityPolicy(config.prefix_affinity, LeastLoadPolicy(rng))
