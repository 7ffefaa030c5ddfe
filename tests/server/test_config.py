"""ServerSettings: one definition per setting; flags > SLUICE_* environment > --config file > default."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.engine.config import EngineConfig
from sluice.errors import ConfigError
from sluice.server.config import load_settings, serve_options
from sluice.settings import setting


def test_env_fills_settings_and_flags_win() -> None:
    env = {"SLUICE_MAX_QUEUED_REQUESTS": "7", "SLUICE_PORT": "9001", "SLUICE_API_KEY": "sk-a, sk-b",
           "SLUICE_KV_CACHE_MEMORY": "1GiB"}  # fmt: skip
    s = load_settings(port=9100, environ=env)
    assert s.max_queued_requests == 7 and s.port == 9100, "flags override the environment"
    assert s.api_key == ["sk-a", "sk-b"], "SLUICE_API_KEY takes a comma-separated list"
    assert s.engine.kv_cache_memory == 2**30 and s.engine.model == "smollm2"


def test_config_file_is_below_env_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("port: 8100\nmax_num_seqs: 8\nkv_cache_memory: 64MiB\nhost: 0.0.0.0\n")
    s = load_settings(str(f), environ={"SLUICE_MAX_NUM_SEQS": "16"}, host="127.0.0.2")
    assert s.port == 8100 and s.engine.kv_cache_memory == 64 * 2**20, "the file fills what nothing else set"
    assert s.engine.max_num_seqs == 16, "the environment overrides the file"
    assert s.host == "127.0.0.2", "a flag overrides the file"
    s2 = load_settings(environ={"SLUICE_CONFIG": str(f)})
    assert s2.port == 8100, "SLUICE_CONFIG names the file too"


def test_engine_options_that_had_no_flag_are_settable() -> None:
    s = load_settings(attention_backend="torch", enable_prefix_caching=False, device="cpu",
                      kv_cache_fraction=0.2)  # fmt: skip
    e = s.engine
    assert (e.attention_backend, e.enable_prefix_caching, e.device, e.kv_cache_fraction) == ("torch", False, "cpu", 0.2)
    env = load_settings(environ={"SLUICE_ENABLE_PREFIX_CACHING": "false", "SLUICE_ATTENTION_BACKEND": "torch"})
    assert env.engine.enable_prefix_caching is False and env.engine.attention_backend == "torch"


def test_every_engine_field_is_a_serve_flag_and_env_var() -> None:
    by_name = {o.name: o for o in serve_options()}
    for f in dataclasses.fields(EngineConfig):
        o = by_name[f.name]
        assert o.flag == "--" + f.name.replace("_", "-") and o.envvars[0] == "SLUICE_" + f.name.upper()
        assert o.help, f"{f.name} needs help text in its setting() metadata"


def test_a_new_field_becomes_a_flag_by_itself() -> None:
    from sluice.settings import options_from_dataclass

    @dataclasses.dataclass
    class Extended(EngineConfig):
        kv_cache_dtype: str = dataclasses.field(default="auto", metadata=setting("KV dtype.", choices=["auto", "fp8"]))

    (o,) = [o for o in options_from_dataclass(Extended) if o.name == "kv_cache_dtype"]
    assert (o.flag, o.envvars[0], o.choices) == ("--kv-cache-dtype", "SLUICE_KV_CACHE_DTYPE", ("auto", "fp8"))


@pytest.mark.parametrize(
    ("kw", "flag"),
    [({"port": 70000}, "--port"), ({"scheduling_policy": "lifo"}, "--scheduling-policy"),
     ({"kv_cache_memory": "lots"}, "--kv-cache-memory"), ({"log_level": "loud"}, "--log-level"),
     ({"max_num_seqs": 0}, "--max-num-seqs"), ({"attention_backend": "magic"}, "--attention-backend")],
)
def test_bad_flag_is_one_readable_config_error(kw: dict, flag: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(**kw)
    assert e.value.message.startswith(flag) and "\n" not in e.value.message


def test_bad_env_value_names_the_variable_and_a_bad_file_key_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--max-num-seqs \(from SLUICE_MAX_NUM_SEQS\)"):
        load_settings(environ={"SLUICE_MAX_NUM_SEQS": "many"})
    f = tmp_path / "s.yaml"
    f.write_text("max_num_seqz: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'max_num_seqz'"):
        load_settings(str(f))


def test_serve_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.server.cli as server_cli
    from sluice.cli import app

    seen: dict = {}
    monkeypatch.setattr(server_cli, "_check_model", lambda spec: None)
    monkeypatch.setattr("sluice.server.runner.run_server", lambda s: seen.setdefault("s", s))
    r = CliRunner().invoke(app, ["serve", "-m", "tiny", "-p", "0", "--no-enable-prefix-caching",
                                 "--api-key", "a", "--api-key", "b", "--kv-cache-memory", "1MiB"])  # fmt: skip
    assert r.exit_code == 0, r.output
    s = seen["s"]
    assert s.engine.model == "tiny" and s.port == 0 and s.engine.enable_prefix_caching is False
    assert s.api_key == ["a", "b"] and s.engine.kv_cache_memory == 2**20


def test_cli_reports_bad_flag_without_traceback() -> None:
    r = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", "--scheduling-policy", "lifo"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, "a configuration error is a usage error (exit 2)"
    assert r.stderr.strip().startswith("sluice: error: --scheduling-policy"), r.stderr
    assert "Traceback" not in r.stderr


def test_every_scheduling_policy_builds_its_own_queue() -> None:
    from sluice.engine.config import SchedulingPolicy
    from sluice.engine.request_queue import make_request_queue

    kinds = {type(make_request_queue(p.value)) for p in SchedulingPolicy}
    assert len(kinds) == len(SchedulingPolicy), "--scheduling-policy names one queue each"
    with pytest.raises(ValueError):
        make_request_queue("lifo")
