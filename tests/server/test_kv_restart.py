"""``sluice serve --kv-disk-dir``: stop (SIGTERM, or kill -9 of every process), start again, same prompts hit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import wait_for

PREFIX = " ".join(f"word{i}" for i in range(150))  # a long shared system prompt
QUESTIONS = [f" question {i}: what comes next?" for i in range(6)]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.model_factory import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


class Serve:
    """One ``sluice serve`` in its own process group (so kill -9 reaches the engine core too)."""

    def __init__(self, model: str, disk: Path):
        env = {**os.environ, "SLUICE_LOG_LEVEL": "warning"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "serve", "--model", model, "--port", "0", "--kv-disk-dir", str(disk),
             "--kv-cache-memory", "16MiB", "--max-model-len", "512"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        lines = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.append(line)
            m = re.search(r"ready in .* at (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return
        raise AssertionError("sluice serve did not start:\n" + "".join(lines))

    def complete(self, prompt: str) -> tuple[str, int]:
        r = httpx.post(self.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        doc = r.json()
        return doc["choices"][0]["text"], doc["usage"]["prompt_tokens"]

    def kv(self) -> dict:
        return httpx.get(self.url + "/admin/kv", timeout=10).json()

    def stop(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(sig)
        self.proc.wait(60)


@pytest.fixture
def servers() -> Iterator[list[Serve]]:
    made: list[Serve] = []
    yield made
    for s in made:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_a_restart_on_the_same_directory_hits_and_answers_the_same(
    tiny_model_dir: str, tmp_path: Path, servers: list[Serve], how: int
) -> None:
    first = Serve(tiny_model_dir, tmp_path)
    servers.append(first)
    before = [first.complete(PREFIX + q) for q in QUESTIONS]
    if how == signal.SIGKILL:  # let the writer finish what the last step queued, then no shutdown path at all
        assert wait_for(lambda: first.kv()["tiers"][1]["stores"]["blocks"] > 0
                        and first.kv()["tiers"][1]["num_blocks"] == first.kv()["tiers"][1]["stores"]["blocks"], 20)
        time.sleep(0.3)
    first.stop(how)
    second = Serve(tiny_model_dir, tmp_path)
    servers.append(second)
    after = [second.complete(PREFIX + q) for q in QUESTIONS]
    assert [t for t, _ in after] == [t for t, _ in before], "outputs must not change across a restart"
    doc = second.kv()
    reusable = sum((n - 1) // 16 * 16 for _, n in after)  # full blocks before each prompt's last token
    hits = sum(t["hit_tokens"] for t in doc["tiers"])
    assert hits / reusable >= 0.95, f"hit rate after the restart {hits / reusable:.2f}: {doc}"
    disk = doc["tiers"][1]
    assert disk["name"] == "disk" and disk["hit_tokens"] > 0 and disk["corrupt"] == 0
    second.stop(signal.SIGTERM)
    assert second.proc.returncode == 0, "SIGTERM drains, checkpoints and exits 0"
