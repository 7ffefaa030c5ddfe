"""Admin endpoints are closed unless an operator opens them (NOTE(admin-access) in sluice.auth),
and runtime LoRA loading is opt-in and confined to --lora-dir (NOTE(lora-roots) in
sluice.server.lora_routes).

Servers run the fake engine (sluice.server.testing) under uvicorn on 127.0.0.1; a server
"bound to 0.0.0.0" is one whose settings say so while the test socket stays on loopback,
so its requests come from 127.0.0.1, the case the rule must refuse.  Requests from other
addresses go through httpx's ASGI transport, which sets the client address.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from sluice.auth import AdminAccess, AdminMode, KeyStore, is_loopback_host
from sluice.errors import ConfigError, InvalidRequestError, PermissionDeniedError
from sluice.obs.advice import advise
from sluice.server.admin import doctor_report
from sluice.server.config import load_settings
from sluice.server.lora_routes import confine_lora_path
from tests.server.conftest import ServerThread, start_fake_server

PROFILE = {"seconds": 0.1, "py_spy": False, "torch_trace": False}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def make_adapter(path: Path) -> Path:
    """A directory that looks like a PEFT adapter (the fake engine loads any; the route checks its files)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("admin-access")
    root = base / "adapters"
    outside = make_adapter(base / "elsewhere" / "secret")
    make_adapter(root / "good")
    (root / "empty").mkdir()
    (root / "link-out").symlink_to(outside)
    make_adapter(root / "file-link")
    (root / "file-link" / "adapter_config.json").unlink()
    (root / "file-link" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    return {"root": root, "outside": outside}


def call(srv: ServerThread, path: str, key: str | None = None, body: Any = None, **headers: str) -> httpx.Response:
    if key:
        headers["authorization"] = f"Bearer {key}"
    if path == "/admin/profile" and body is None:
        body = PROFILE
    return httpx.post(srv.url + path, json=body if body is not None else {}, headers=headers, timeout=30)


def load(srv: ServerThread, name: str, path: Path | str, key: str | None = None) -> httpx.Response:
    return call(srv, "/v1/load_lora_adapter", key, {"lora_name": name, "lora_path": str(path)})


def assert_openai_403(r: httpx.Response, why: str) -> None:
    assert r.status_code == 403, f"{why}: {r.status_code} {r.text}"
    err = r.json()["error"]
    assert err["type"] == "permission_error" and err["code"] == "admin_key_required", r.text
    assert "--admin-key" in err["message"] and "--allow-admin-without-key" in err["message"], \
        "the 403 must say how to open the endpoints"


# ---------------------------------------------------------------- the rule, without sockets


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("example.com", False),
    ("", False), (None, False), ("testclient", False),
])  # fmt: skip
def test_loopback_addresses(host: str | None, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_the_mode_follows_keys_bind_address_and_the_opt_out() -> None:
    none, user = KeyStore(), KeyStore.build(["sk-user"])
    admin = KeyStore.build(admin_keys=["sk-admin"])
    assert AdminAccess(none, host="127.0.0.1").mode is AdminMode.LOOPBACK
    assert AdminAccess(none, host="0.0.0.0").mode is AdminMode.CLOSED
    assert AdminAccess(user, host="127.0.0.1").mode is AdminMode.CLOSED, "keys but no admin key: closed"
    assert AdminAccess(none, host="0.0.0.0", allow_without_key=True).mode is AdminMode.OPEN
    assert AdminAccess(admin, host="0.0.0.0", allow_without_key=True).mode is AdminMode.KEY, "a key wins"
    assert not admin.enabled, "an --admin-key alone must not switch on keys for the inference routes"


def test_loopback_mode_refuses_remote_and_proxied_clients() -> None:
    access = AdminAccess(KeyStore(), host="127.0.0.1")
    assert access.check({}, "127.0.0.1").name == "anonymous"
    assert access.check({}, "::1").name == "anonymous"
    for headers, client in (({}, "10.0.0.8"), ({}, None), ({"x-forwarded-for": "203.0.113.9"}, "127.0.0.1"),
                            ({"forwarded": "for=203.0.113.9"}, "127.0.0.1")):  # fmt: skip
        with pytest.raises(PermissionDeniedError):
            access.check(headers, client)


def test_the_choice_is_logged_once_at_start_up(caplog: pytest.LogCaptureFixture) -> None:
    from sluice.server.app import build_app

    with caplog.at_level(logging.INFO, logger="sluice.server"):
        build_app(load_settings(model="fake", host="0.0.0.0", environ={}))
    lines = [r.getMessage() for r in caplog.records if "admin endpoints" in r.getMessage()]
    assert len(lines) == 1 and "closed" in lines[0] and "0.0.0.0" in lines[0], lines


# ---------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def exposed(roots: dict[str, Path]) -> Iterator[ServerThread]:
    srv = start_fake_server(host="0.0.0.0", enable_runtime_lora=True, lora_dir=[str(roots["root"])])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def local(roots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    srv = start_fake_server(host="127.0.0.1", enable_runtime_lora=True, lora_dir=[str(roots["root"])],
                            profile_dir=str(tmp_path_factory.mktemp("profiles")))  # fmt: skip
    yield srv
    srv.stop()


def test_bound_beyond_loopback_without_keys_serves_the_api_but_not_the_admin_routes(
    exposed: ServerThread, roots: dict[str, Path]
) -> None:
    r = httpx.post(exposed.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200, "the inference routes stay open without keys"
    for path in ("/admin/profile", "/admin/kv/checkpoint"):
        assert_openai_403(call(exposed, path), f"{path} from 127.0.0.1 on a server bound to 0.0.0.0")
    assert_openai_403(load(exposed, "good", roots["root"] / "good"), "a LoRA load")
    assert_openai_403(call(exposed, "/v1/unload_lora_adapter", body={"lora_name": "good"}), "a LoRA unload")
    assert httpx.get(exposed.url + "/admin/kv", timeout=10).status_code == 403
    assert httpx.get(exposed.url + "/admin/profile", timeout=10).status_code == 403


def test_bound_to_loopback_without_keys_the_admin_routes_answer_local_clients(
    local: ServerThread, roots: dict[str, Path]
) -> None:
    assert call(local, "/admin/kv/checkpoint").status_code == 200
    r = call(local, "/admin/profile")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip", r.text
    r = load(local, "local-good", roots["root"] / "good")
    assert r.status_code == 200, r.text
    assert call(local, "/v1/unload_lora_adapter", body={"lora_name": "local-good"}).status_code == 200
    r = call(local, "/admin/kv/checkpoint", **{"x-forwarded-for": "203.0.113.9"})
    assert_openai_403(r, "a request through a proxy on this machine is not local")


async def test_bound_to_loopback_a_remote_client_gets_403(local: ServerThread, roots: dict[str, Path]) -> None:
    transport = httpx.ASGITransport(app=local.app, client=("192.0.2.10", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://sluice") as http:
        for path, body in (("/admin/profile", PROFILE), ("/admin/kv/checkpoint", {}),
                           ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(roots["root"] / "good")})):  # fmt: skip
            assert_openai_403(await http.post(path, json=body), f"{path} from 192.0.2.10")


def test_with_an_admin_key_other_keys_get_403_and_the_admin_key_200(
    roots: dict[str, Path], tmp_path: Path
) -> None:
    srv = start_fake_server(host="0.0.0.0", api_key=["sk-user"], admin_key=["sk-admin"], enable_runtime_lora=True,
                            lora_dir=[str(roots["root"])], profile_dir=str(tmp_path / "p"))  # fmt: skip
    try:
        for path in ("/admin/profile", "/admin/kv/checkpoint"):
            assert call(srv, path).status_code == 401, "no key"
            r = call(srv, path, "sk-user")
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
            assert call(srv, path, "sk-admin").status_code == 200, f"{path} with the admin key"
        assert load(srv, "k", roots["root"] / "good", "sk-user").status_code == 403
        assert load(srv, "k", roots["root"] / "good", "sk-admin").status_code == 200
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-user"})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_an_admin_key_alone_guards_the_admin_routes_only() -> None:
    srv = start_fake_server(host="0.0.0.0", admin_key=["sk-admin"])
    try:
        assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert call(srv, "/admin/kv/checkpoint").status_code == 401
        assert call(srv, "/admin/kv/checkpoint", "sk-admin").status_code == 200
    finally:
        srv.stop()


def test_allow_admin_without_key_opens_them_behind_the_operators_proxy() -> None:
    srv = start_fake_server(host="0.0.0.0", allow_admin_without_key=True)
    try:
        assert call(srv, "/admin/kv/checkpoint").status_code == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------- runtime LoRA loading


def test_runtime_lora_loading_is_off_by_default(local: ServerThread) -> None:
    srv = start_fake_server()
    try:
        r = load(srv, "x", "/tmp")
        assert r.status_code == 404 and "--enable-runtime-lora" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def test_runtime_lora_needs_a_lora_dir() -> None:
    with pytest.raises(ConfigError, match="--lora-dir"):
        load_settings(model="fake", enable_runtime_lora=True, environ={})
    s = load_settings(model="fake", environ={"SLUICE_ENABLE_RUNTIME_LORA": "1", "SLUICE_LORA_DIR": "/a,/b"})
    assert s.enable_runtime_lora and s.lora_dir == ["/a", "/b"]


def test_paths_outside_the_roots_get_400_and_an_adapter_inside_loads(
    local: ServerThread, roots: dict[str, Path]
) -> None:
    root = roots["root"]
    cases = {
        "outside every root": roots["outside"],
        "escapes with ..": f"{root}/good/../../elsewhere/secret",
        "a symlink out of the root": root / "link-out",
        "an adapter file linked out of the root": root / "file-link",
        "the root itself, no adapter in it": root,
        "a directory without an adapter": root / "empty",
        "a relative path": "elsewhere/secret",
    }
    for why, path in cases.items():
        r = load(local, "bad", path)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", f"{why}: {r.text}"
    assert "bad" not in [m["id"] for m in httpx.get(local.url + "/v1/models").json()["data"]]
    r = load(local, "inside", f"{root}/empty/../good")
    assert r.status_code == 200, r.text
    models = {m["id"]: m for m in httpx.get(local.url + "/v1/models").json()["data"]}
    assert models["inside"]["root"] == os.path.realpath(root / "good"), "the engine gets the resolved path"


def test_outside_the_roots_the_error_does_not_say_whether_the_path_exists(roots: dict[str, Path]) -> None:
    def message(path: str) -> str:
        with pytest.raises(InvalidRequestError) as e:
            confine_lora_path(path, [str(roots["root"])])
        return e.value.message.replace(path, "<path>")

    exists, missing = str(roots["outside"]), str(roots["outside"].parent / "no-such-adapter")
    assert message(exists) == message(missing) == message("/etc")
    assert message(f"{roots['root']}/../elsewhere/secret") == message(exists)


# ---------------------------------------------------------------- adapter file sizes, sluice doctor


def test_adapter_files_are_size_checked_before_they_are_read(tmp_path: Path) -> None:
    from sluice.engine.lora_manager import MAX_CONFIG_BYTES, check_file_sizes, max_weights_bytes

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=128, head_dim=16, num_heads=4, num_kv_heads=2,
                          num_layers=2)  # fmt: skip
    limit = max_weights_bytes(cfg, max_rank=8)  # type: ignore[arg-type]
    real = 2 * 8 * 7 * 2 * 128 * 8  # layers x rank x targets x (A, B) x widest side x float64: an upper bound
    assert real < limit < real + (2 << 20), "the bound fits a real adapter and little more"
    adapter = make_adapter(tmp_path / "a")
    check_file_sizes(str(adapter), limit)
    with open(adapter / "adapter_model.safetensors", "wb") as f:
        f.truncate(limit + 1)  # sparse: no disk used
    with pytest.raises(InvalidRequestError, match="adapter_model.safetensors is"):
        check_file_sizes(str(adapter), limit)
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with open(adapter / "adapter_config.json", "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(InvalidRequestError, match="adapter_config.json is"):
        check_file_sizes(str(adapter), limit)


@pytest.mark.parametrize(("environ", "warns"), [
    ({"SLUICE_HOST": "0.0.0.0"}, True),
    ({"SLUICE_HOST": "0.0.0.0", "SLUICE_API_KEY": "sk-a"}, False),
    ({"SLUICE_HOST": "127.0.0.1"}, False),
    ({}, False),
])  # fmt: skip
def test_doctor_warns_when_serve_would_listen_beyond_loopback_without_keys(
    environ: dict[str, str], warns: bool
) -> None:
    report = doctor_report(environ)
    warnings = [a for a in advise(report) if a.topic == "exposure"]
    assert bool(warnings) is warns, (report, warnings)
    if warns:
        assert "0.0.0.0" in warnings[0].problem and "--api-key" in warnings[0].fix


def test_deploy_files_give_every_process_an_admin_key_from_a_secret() -> None:
    import yaml

    deploy = Path(__file__).resolve().parents[2] / "deploy"
    compose = yaml.safe_load((deploy / "compose.yaml").read_text())
    for name in ("replica-1", "replica-2", "gateway"):
        env = compose["services"][name]["environment"]
        assert env["SLUICE_ADMIN_KEY"] == "${SLUICE_ADMIN_KEY:-}", f"{name}: the key comes from deploy/.env"
    assert ".env" in (deploy / ".gitignore").read_text().split(), "the compose secret is never committed"
    pods = [d["spec"]["template"]["spec"] for p in ("server.yaml", "gateway.yaml")
            for d in yaml.safe_load_all((deploy / "k8s" / p).read_text()) if d and d["kind"] == "Deployment"]  # fmt: skip
    assert len(pods) == 2
    for pod in pods:
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        ref = env["SLUICE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "sluice-admin" and ref["key"] == "admin-key", ref
