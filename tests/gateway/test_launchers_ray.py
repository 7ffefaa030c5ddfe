"""The Ray launcher on a local Ray head started by this module: two replicas as
Ray actors (each running a real ``sluice serve`` of a tiny model), discovered
through Ray, served through the gateway, and a clean scale-down to one."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.gateway.autoscale import Autoscaler
from sluice.gateway.config import AutoscaleConfig, LauncherConfig, LauncherName
from sluice.gateway.launchers import ReplicaSpec, make_launcher
from sluice.gateway.launchers.ray import RayLauncher
from tests.gateway.conftest import gateway_config, serve_gateway

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

NAMESPACE = "sluice-test"


@pytest.fixture(scope="module")
def ray_head() -> Iterator[None]:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace=NAMESPACE,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("ray_tiny") / "tiny", arch="llama")


def _actor_names() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE)


async def test_ray_launcher_serves_two_replicas_through_the_gateway_and_scales_down(ray_head: None, model_dir: Path) -> None:
    lcfg = LauncherConfig(kind=LauncherName.RAY, cpus_per_replica=1, ray_namespace=NAMESPACE, host="127.0.0.1", ready_timeout_s=150, stop_timeout_s=20)
    launcher = make_launcher(lcfg)
    assert isinstance(launcher, RayLauncher)
    spec = ReplicaSpec("tiny", "v1", str(model_dir), extra_args=("--kv-cache-memory", "64MiB", "--log-level", "warning"))
    try:
        a, b = await asyncio.gather(launcher.launch(spec), launcher.launch(spec))
        assert a.url != b.url and all(r.url.startswith("http://127.0.0.1:") for r in (a, b))
        assert len(_actor_names()) == 2, "each replica must be a named Ray actor"

        fresh = RayLauncher(lcfg)  # e.g. a restarted gateway
        found = await fresh.discover()
        assert sorted(r.url for r in found) == sorted([a.url, b.url]), "replicas must be discoverable through Ray"
        assert found[0].spec == spec

        cfg = gateway_config([a.url], model="tiny", policy="round_robin",
                             timeouts={"connect_s": 2.0, "first_byte_s": 60.0, "idle_s": 60.0})  # fmt: skip
        auto = AutoscaleConfig(model_path=str(model_dir), min_replicas=1, max_replicas=2, launcher=lcfg)
        async with serve_gateway(cfg) as (url, app), httpx.AsyncClient(timeout=60) as http:
            scaler = Autoscaler(app.state.gateway.pool, {"tiny": auto}, {"tiny": launcher})
            scaler.adopt("tiny", a)
            scaler.adopt("tiny", b)
            assert scaler.num_replicas("tiny") == 2
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 8}
            rs = await asyncio.gather(*(http.post(url + "/v1/completions", json=body) for _ in range(6)))
            assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs]
            by = Counter(r.headers["x-sluice-replica"] for r in rs)
            assert set(by) == {a.url, b.url}, f"the gateway must serve through both Ray replicas: {by}"

            [victim] = scaler.scale_down("tiny", 1)
            await scaler.wait_drained()
            assert len(_actor_names()) == 1, "a scale-down must remove its Ray actor"
            assert [r.url for r in launcher.replicas()] == [u for u in (a.url, b.url) if u != victim.url]
            rs = await asyncio.gather(*(http.post(url + "/v1/completions", json=body) for _ in range(3)))
            assert [r.status_code for r in rs] == [200] * 3, "the remaining replica keeps serving"
            assert {r.headers["x-sluice-replica"] for r in rs} == {launcher.replicas()[0].url}
            with pytest.raises(httpx.TransportError):
                await http.get(victim.url + "/health")
    finally:
        await launcher.close()
    assert _actor_names() == [], "closing the launcher must remove every actor"
