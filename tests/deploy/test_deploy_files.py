"""The deployment files match the current sluice: every ``sluice`` flag they pass
exists (and its value parses), ports agree from container to Service to scrape
target, mounted paths are the ones the commands read, probe paths answer on a
live server and gateway, and every metric the autoscaler reads is exposed.

Tools that are absent here (a Docker engine, a Kubernetes cluster, promtool)
are skipped with the reason printed (``-ra``); the static checks always run.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import yaml

from sluice.cli import app as sluice_app
from sluice.gateway.config import load_config
from sluice.server.config import load_settings, serve_options
from tests.deploy.promql_names import Use, exposed_from_text, problems

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _k8s() -> list[dict[str, Any]]:
    return [d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in _yaml_docs(p)]  # fmt: skip


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _containers(kind: str = "Deployment") -> dict[str, dict[str, Any]]:
    """Deployment name -> (its pod spec, its first container)."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in _k8s() if d["kind"] == kind}


def _dockerfile_argv() -> list[str]:
    text = (DEPLOY / "docker/Dockerfile").read_text()
    entry = yaml.safe_load(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    cmd = yaml.safe_load(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert entry == ["sluice"], "the image's entry point is the sluice command"
    return list(cmd)


def _shell_lines(path: Path) -> list[str]:
    """The lines that are commands: a Markdown file's ```bash blocks, else a file's comment lines."""
    text = path.read_text().splitlines()
    if path.suffix != ".md":
        return [ln.strip().lstrip("#").strip() for ln in text]
    out, inside = [], False
    for ln in text:
        if ln.startswith("```"):
            inside = ln.strip() in ("```bash", "```sh", "```console")
            continue
        if inside:
            out.append(ln.strip())
    return out


def _documented_argv(path: Path, prefix: str = "sluice") -> list[list[str]]:
    """``sluice ...`` commands of a file (continuation lines joined)."""
    lines = _shell_lines(path)
    out, cur = [], ""
    for ln in lines:
        cur = f"{cur} {ln}" if cur else ln
        if cur.endswith("\\"):
            cur = cur[:-1]
            continue
        m = re.search(r"(?:^|\s|/)(?:sluice:[a-z]+|" + prefix + r") ((?:serve|gateway|doctor|profile)\b.*)$", cur)
        if m:
            out.append(shlex.split(m.group(1).split("#")[0].split(" &")[0]))
        cur = ""
    return out


def sluice_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after 'sluice') of every sluice invocation in deploy/ and docs/operations.md."""
    out = [("Dockerfile CMD", _dockerfile_argv())]
    out += [("Dockerfile comment", argv) for argv in _documented_argv(DEPLOY / "docker/Dockerfile")]
    for name, svc in _compose()["services"].items():
        if str(svc.get("image", "")).startswith("sluice"):
            out.append((f"compose service {name}", [str(a) for a in svc["command"]]))
    for name, spec in _containers().items():
        for c in spec["containers"]:
            if c["image"] == "sluice":
                out.append((f"k8s Deployment {name}", [str(a) for a in c["args"]]))
    out += [("docs/operations.md", argv) for argv in _documented_argv(ROOT / "docs/operations.md")]
    return out


def _flags(argv: list[str]) -> dict[str, str | None]:
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-"):
            name, eq, value = a.partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                value, i = argv[i + 1], i + 1
            flags[name] = value if (eq or value) else None
        i += 1
    return flags


def test_every_sluice_flag_in_the_deploy_files_and_docs_exists() -> None:
    group = typer.main.get_command(sluice_app)
    commands = sluice_commands()
    assert len(commands) >= 6, commands
    bad = []
    for where, argv in commands:
        sub = argv[0]
        if sub not in group.commands:  # type: ignore[attr-defined]
            bad.append(f"{where}: no command 'sluice {sub}'")
            continue
        known = {o for p in group.commands[sub].params for o in (*p.opts, *p.secondary_opts)}  # type: ignore[attr-defined]
        bad += [f"{where}: 'sluice {sub}' has no flag {f}" for f in _flags(argv[1:]) if f not in known]
    assert not bad, "\n".join(bad)


def test_every_serve_command_parses_into_valid_settings() -> None:
    by_flag = {f: o for o in serve_options() for f in o.flags}
    for where, argv in sluice_commands():
        if argv[0] != "serve":
            continue
        given: dict[str, Any] = {}
        for flag, value in _flags(argv[1:]).items():
            o = by_flag[flag]
            given[o.name] = [value] if o.multiple else (True if o.kind is bool and value is None else value)
        s = load_settings(environ={}, **given)  # raises ConfigError naming the flag
        assert s.engine.model == "smollm2", where


def test_ports_agree_from_command_to_container_to_service_to_scrape_target() -> None:
    compose, k8s = _compose(), _containers()
    gw_file = load_config(DEPLOY / "gateway.yaml")
    for name, svc in compose["services"].items():
        if name.startswith("replica"):
            port = _flags(svc["command"])["--port"]
            assert any(p.endswith(f":{port}") for p in svc["ports"]), f"{name} publishes its --port {port}"
            assert f"http://{name}:{port}" in {r.url for v in gw_file.models["smollm2"].versions for r in v.replicas}
    assert any(p.endswith(f":{gw_file.port}") for p in compose["services"]["gateway"]["ports"])
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in scrape["scrape_configs"]}
    replica_port = _flags(compose["services"]["replica-1"]["command"])["--port"]
    assert set(targets["sluice-serve"]) == {f"replica-1:{replica_port}", f"replica-2:{replica_port}"}
    assert targets["sluice-gateway"] == [f"gateway:{gw_file.port}"]

    serve = k8s["sluice-serve"]["containers"][0]
    assert [p["containerPort"] for p in serve["ports"]] == [int(_flags(serve["args"])["--port"])]
    gw_cm = next(d for d in _k8s() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sluice-gateway")
    gw_k8s = yaml.safe_load(gw_cm["data"]["gateway.yaml"])
    assert [p["containerPort"] for p in k8s["sluice-gateway"]["containers"][0]["ports"]] == [gw_k8s["port"]]
    services = {d["metadata"]["name"]: d for d in _k8s() if d["kind"] == "Service"}
    assert services["sluice-serve"]["spec"]["ports"][0]["port"] == serve["ports"][0]["containerPort"]
    (url,) = [r["url"] for v in gw_k8s["models"]["smollm2"]["versions"] for r in v["replicas"]]
    assert url == f"http://sluice-serve:{services['sluice-serve']['spec']['ports'][0]['port']}"


def test_gateway_configs_load_and_mounted_paths_are_the_ones_read(tmp_path: Path) -> None:
    compose = _compose()
    gw = compose["services"]["gateway"]
    config_path = _flags(gw["command"])["--config"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in gw["volumes"]}
    assert mounts[config_path] == "./gateway.yaml", "the gateway reads the file compose mounts"
    load_config(DEPLOY / "gateway.yaml")
    prom = compose["services"]["prometheus"]
    prom_mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    for rule_file in scrape["rule_files"]:
        assert prom_mounts[rule_file] == "./prometheus/rules.yml", f"{rule_file} must be the generated rules"
    assert any(a == "--config.file=/etc/prometheus/prometheus.yml" for a in prom["command"])
    graf = compose["services"]["grafana"]
    graf_mounts = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"]}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/sluice.yaml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert graf_mounts[f"{dash_dir}/sluice.json"] == "./grafana/sluice.json"
    assert graf_mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"

    k8s_gw = _containers()["sluice-gateway"]
    gw_cm = next(d for d in _k8s() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sluice-gateway")
    (tmp_path / "gateway.yaml").write_text(gw_cm["data"]["gateway.yaml"])
    load_config(tmp_path / "gateway.yaml")
    mount = k8s_gw["containers"][0]["volumeMounts"][0]["mountPath"]
    assert _flags(k8s_gw["containers"][0]["args"])["--config"] == f"{mount}/gateway.yaml"


def test_sigterm_drain_fits_the_grace_periods() -> None:
    spec = _containers()["sluice-serve"]
    c = spec["containers"][0]
    drain = float(_flags(c["args"])["--shutdown-timeout"])  # type: ignore[arg-type]
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    engine_stop = 5.0  # EngineClient.close: SIGTERM, then SIGKILL after 5 s
    assert pre_stop + drain + engine_stop < spec["terminationGracePeriodSeconds"], (
        "Kubernetes must not SIGKILL a pod that is still finishing its requests"
    )
    assert c["readinessProbe"]["httpGet"]["path"] == "/health", "readiness follows /health (503 while draining)"
    assert c["livenessProbe"]["httpGet"]["path"] != "/health", "liveness must not kill a draining pod"
    for name, svc in _compose()["services"].items():
        if name.startswith("replica"):
            grace = float(svc["stop_grace_period"].rstrip("s"))
            assert float(_flags(svc["command"])["--shutdown-timeout"]) < grace  # type: ignore[arg-type]


def test_alert_job_names_exist_in_every_scrape_config() -> None:
    rules = (DEPLOY / "prometheus/rules.yml").read_text()
    jobs = set(re.findall(r'job="([^"]+)"', rules))
    assert jobs == {"sluice-serve", "sluice-gateway"}
    compose_jobs = {j["job_name"] for j in yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())["scrape_configs"]}
    cm = next(d for d in _k8s() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sluice-prometheus")
    k8s_jobs = {j["job_name"] for j in yaml.safe_load(cm["data"]["prometheus.yml"])["scrape_configs"]}
    assert jobs <= compose_jobs and jobs <= k8s_jobs


def _http_paths() -> list[tuple[str, str, str]]:
    """(where, server|gateway, path) of every probe, health check and scrape path."""
    out = []
    for name, spec in _containers().items():
        role = "server" if name == "sluice-serve" else "gateway"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in spec["containers"][0]:
                out.append((f"k8s {name} {probe}", role, spec["containers"][0][probe]["httpGet"]["path"]))
    for name, svc in _compose()["services"].items():
        test = " ".join(map(str, (svc.get("healthcheck") or {}).get("test", [])))
        for m in re.finditer(r"http://127\.0\.0\.1:(\d+)(/\w*)", test):
            out.append((f"compose {name} healthcheck", "server" if m.group(1) == "8000" else "gateway", m.group(2)))
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    for j in scrape["scrape_configs"]:
        out.append((f"prometheus job {j['job_name']}", "server" if j["job_name"] == "sluice-serve" else "gateway",
                    j.get("metrics_path", "/metrics")))  # fmt: skip
    return out


@pytest.mark.slow
def test_probe_and_scrape_paths_answer_on_a_live_server_and_gateway(live_stack) -> None:
    paths = _http_paths()
    assert {p for _, _, p in paths} >= {"/health", "/metrics"}
    for where, role, path in paths:
        base = live_stack.serve_url if role == "server" else live_stack.gateway_url
        r = httpx.get(base + path, timeout=10)
        assert r.status_code == 200, f"{where}: GET {path} on the {role} answered {r.status_code}"


@pytest.mark.slow
def test_autoscaling_metrics_exist_on_a_live_server(live_stack) -> None:
    exposed = exposed_from_text(live_stack.serve_metrics)
    uses = []
    for d in _k8s():
        if d["kind"] == "HorizontalPodAutoscaler":
            for m in d["spec"]["metrics"]:
                uses.append(Use(f"HPA {d['metadata']['name']}", m["pods"]["metric"]["name"]))
        if d["kind"] == "ConfigMap" and "config.yaml" in d["data"]:
            for rule in yaml.safe_load(d["data"]["config.yaml"])["rules"]:
                uses.append(Use("prometheus-adapter seriesQuery", rule["seriesQuery"]))
                uses.append(Use("prometheus-adapter metricsQuery",
                                rule["metricsQuery"].replace("<<.Series>>", rule["name"]["as"])
                                .replace("<<.LabelMatchers>>", "").replace("<<.GroupBy>>", "pod")))  # fmt: skip
    assert len(uses) >= 4
    # namespace / pod are added by the scrape config's relabelling, like job and instance
    exposed.labels = {k: v | {"namespace", "pod"} for k, v in exposed.labels.items()}
    bad = problems(uses, exposed)
    assert not bad, "\n".join(bad)


# -- the real tools, where this machine has them ---------------------------------------


def _tool_or_skip(cmd: list[str], why: str) -> None:
    if shutil.which(cmd[0]) is None:
        pytest.skip(f"{cmd[0]} is not installed here: {why} not checked")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"`{' '.join(cmd)}` failed here ({(r.stderr or r.stdout).strip().splitlines()[-1:]}): {why} not checked")


def test_docker_image_builds() -> None:
    _tool_or_skip(["docker", "info"], "docker build of deploy/docker/Dockerfile")
    r = subprocess.run(["docker", "build", "-f", "deploy/docker/Dockerfile", "-t", "sluice:test", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


def test_compose_file_is_valid_for_docker_compose() -> None:
    _tool_or_skip(["docker", "compose", "version"], "docker compose config of deploy/compose.yaml")
    r = subprocess.run(["docker", "compose", "-f", "deploy/compose.yaml", "config", "--quiet"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_k8s_manifests_build_with_kustomize_and_validate_on_a_cluster() -> None:
    _tool_or_skip(["kubectl", "version", "--client"], "kubectl kustomize deploy/k8s")
    r = subprocess.run(["kubectl", "kustomize", "deploy/k8s"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout) if d]
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= set(kinds)
    _tool_or_skip(["kubectl", "version", "--request-timeout=5s"], "kubectl apply --dry-run=server (no cluster)")
    r = subprocess.run(["kubectl", "apply", "--dry-run=server", "-k", "deploy/k8s"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_rules_and_scrape_config_pass_promtool(tmp_path: Path) -> None:
    _tool_or_skip(["promtool", "--version"], "promtool check rules / check config (apt-get install prometheus)")
    r = subprocess.run(["promtool", "check", "rules", "deploy/prometheus/rules.yml"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # the scrape config as Prometheus in compose reads it, rules path pointed at the repository's file
    cfg = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    cfg["rule_files"] = [str(DEPLOY / "prometheus/rules.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
