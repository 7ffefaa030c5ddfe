"""Adapter-aware routing: a request whose ``model`` is a LoRA adapter goes to a replica that has it.

Replicas say which adapters they serve in their ``/metrics``
(``sluice_lora_adapter_loaded{adapter}``: 1 in memory, 0 registered and
loaded on first use; parsed into ``ReplicaLoad.lora_adapters``), so the
gateway keeps no adapter state of its own::

    model_of_adapter(pool, "sql")        -> "smollm2": the configured model whose replicas list it
    prefer_adapter(candidates, "sql")    -> the candidates that have it in memory ("lora_loaded"),
                                            else those that list it ("lora_registered"), else all
                                            of them ("lora_fallback"); the routing policy picks
                                            among that subset as usual

NOTE(lora-routing): a replica that has the adapter in memory answers without
a load (the TTFT of a cold adapter is its load time, tens of ms to seconds);
among several the usual policy balances.  An adapter loaded through one
replica's ``/v1/load_lora_adapter`` is routable once the next scrape saw it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sluice.gateway.replica import Replica

__all__ = ["model_of_adapter", "prefer_adapter", "adapters_by_model"]


def model_of_adapter(replicas: Iterable[Replica], adapter: str) -> str | None:
    """The gateway model whose replicas serve ``adapter`` (the first in config order), or None."""
    for r in replicas:
        if adapter in r.load.lora_adapters:
            return r.model
    return None


def prefer_adapter(candidates: Sequence[Replica], adapter: str) -> tuple[list[Replica], str]:
    """The candidates to route an adapter request among, and why (a ``decisions`` metric reason)."""
    loaded = [r for r in candidates if r.load.lora_adapters.get(adapter)]
    if loaded:
        return loaded, "lora_loaded"
    registered = [r for r in candidates if adapter in r.load.lora_adapters]
    if registered:
        return registered, "lora_registered"
    return list(candidates), "lora_fallback"


def adapters_by_model(replicas: Iterable[Replica]) -> dict[str, str]:
    """adapter -> its model, over every replica (``/v1/models`` of the gateway)."""
    out: dict[str, str] = {}
    for r in replicas:
        for name in r.load.lora_adapters:
            out.setdefault(name, r.model)
    return out
