"""ServerSettings: flags, SLUICE_* environment, readable errors."""

from __future__ import annotations

import pytest

from sluice.errors import InvalidRequestError
from sluice.server.config import load_settings


def test_env_fills_settings_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MAX_QUEUED_REQUESTS", "7")
    monkeypatch.setenv("SLUICE_PORT", "9001")
    monkeypatch.setenv("SLUICE_API_KEY", "sk-a, sk-b")
    monkeypatch.setenv("SLUICE_KV_CACHE_MEMORY", "1GiB")
    s = load_settings(port=9100)
    assert s.max_queued_requests == 7 and s.port == 9100, "flags override the environment"
    assert s.api_key == ["sk-a", "sk-b"], "SLUICE_API_KEY takes a comma-separated list"
    assert s.kv_cache_memory == 2**30
    cfg = s.engine_config()
    assert cfg.kv_cache_memory == 2**30 and cfg.model == "smollm2"


@pytest.mark.parametrize(
    ("kw", "flag"),
    [({"port": 70000}, "--port"), ({"scheduling_policy": "lifo"}, "--scheduling-policy"),
     ({"kv_cache_memory": "lots"}, "--kv-cache-memory"), ({"log_level": "loud"}, "--log-level")],
)
def test_bad_flag_is_one_readable_line(kw: dict, flag: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        load_settings(**kw)
    assert e.value.message.startswith(flag) and "\n" not in e.value.message


def test_cli_reports_bad_flag_without_traceback() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", "--scheduling-policy", "lifo"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().startswith("sluice: error: --scheduling-policy"), r.stderr
    assert "Traceback" not in r.stderr
