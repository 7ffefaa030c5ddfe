"""The gateway's /admin/* follows the rule of `sluice serve` (NOTE(admin-access) in sluice.auth):
an admin key, or --allow-admin-without-key, or no keys at all on a loopback-bound gateway and a
loopback client; 403 otherwise.

In-process: httpx's ASGI transport sets the client address; the admin views need no replica.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from sluice.gateway.app import build_app
from tests.gateway.conftest import gateway_config

ADMIN_GETS = ("/admin/replicas", "/admin/models", "/admin/degradation", "/admin/rollout", "/admin/autoscale")


async def get(client: str, path: str, key: str | None = None, **config: Any) -> httpx.Response:
    app = build_app(gateway_config(["http://127.0.0.1:9"], **config), run_scraper=False)
    transport = httpx.ASGITransport(app=app, client=(client, 40000))
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        return await http.get(path, headers=headers)


def assert_403(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["type"] == "permission_error" and "--admin-key" in err["message"], r.text


@pytest.mark.parametrize("path", ADMIN_GETS)
async def test_bound_beyond_loopback_without_keys_admin_is_closed_even_from_loopback(path: str) -> None:
    assert_403(await get("127.0.0.1", path, host="0.0.0.0"))


async def test_bound_to_loopback_without_keys_local_clients_only() -> None:
    for path in ADMIN_GETS:
        r = await get("127.0.0.1", path)
        assert r.status_code == 200, f"{path} from 127.0.0.1 on a loopback gateway: {r.text}"
    assert_403(await get("192.0.2.10", "/admin/replicas"))


async def test_with_an_admin_key_other_keys_get_403_and_the_admin_key_200() -> None:
    cfg = {"host": "0.0.0.0", "api_keys": ["sk-user"], "admin_keys": ["sk-admin"]}
    assert (await get("192.0.2.10", "/admin/replicas", **cfg)).status_code == 401, "no key"
    r = await get("192.0.2.10", "/admin/replicas", "sk-user", **cfg)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    assert (await get("192.0.2.10", "/admin/replicas", "sk-admin", **cfg)).status_code == 200


async def test_keys_but_no_admin_key_is_closed_and_the_opt_out_opens_it() -> None:
    assert_403(await get("127.0.0.1", "/admin/replicas", "sk-user", api_keys=["sk-user"]))
    r = await get("192.0.2.10", "/admin/replicas", host="0.0.0.0", allow_admin_without_key=True)
    assert r.status_code == 200, r.text


def test_admin_key_flag_and_environment(caplog: pytest.LogCaptureFixture) -> None:
    from sluice.gateway.config import load_config

    cfg = load_config(None, environ={"SLUICE_ADMIN_KEY": "sk-a", "SLUICE_ALLOW_ADMIN_WITHOUT_KEY": "true"},
                      models={"m": {"versions": [{"name": "v1", "replicas": ["http://127.0.0.1:9"]}]}})  # fmt: skip
    assert cfg.admin_keys == ["sk-a"] and cfg.allow_admin_without_key
    with caplog.at_level(logging.INFO, logger="sluice.gateway"):
        build_app(cfg, run_scraper=False)
    assert any("need an admin key" in r.getMessage() for r in caplog.records), "the choice is logged at start-up"
