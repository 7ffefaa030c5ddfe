"""A KV cache that survives a restart: int8 KV, a disk tier, the same prompts in a new process.

    python examples/kv_restart.py                 # uses a fresh temporary --kv-disk-dir
    python examples/kv_restart.py --dir /tmp/kv   # or yours (run it twice: both runs hit)

The first process answers three questions about one long document and exits;
its prefix blocks were written to the disk tier as they were computed.  A
second process (a restart) asks the same questions: the document's KV comes
from disk instead of being recomputed, and the answers are the same.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile

from sluice import LLM, SamplingParams

DOCUMENT = " ".join(
    f"Section {i}: the sluice gate number {i} opens at {6 + i % 12} o'clock and closes at {18 + i % 5} o'clock."
    for i in range(40)
)
QUESTIONS = ["When does gate 7 open?", "When does gate 12 close?", "Which gate opens at 9 o'clock?"]


def run(disk_dir: str, label: str) -> list[str]:
    llm = LLM("smollm2", kv_cache_dtype="int8", kv_disk_dir=disk_dir, kv_cache_memory=64 << 20)
    prompts = [f"{DOCUMENT}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    answers = []
    for p in prompts:  # one at a time, so each TTFT is its own
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12))[0]
        answers.append(out.text)
        print(f"[{label}] cached {out.num_cached_tokens:4d}/{len(out.prompt_token_ids)} prompt tokens, "
              f"ttft {out.timings.ttft * 1e3:6.0f} ms  {out.text.strip()!r}")
    disk = llm.engine.make_stats().kv_tiers[0]
    print(f"[{label}] disk tier: {disk.num_blocks} blocks, {disk.num_bytes / 2**20:.1f} MiB, "
          f"{disk.hit_tokens} prompt tokens loaded from it")
    llm.engine.close()  # writes what the tier lacks (a server does this on SIGTERM) and stops its threads
    return answers


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--after-restart", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.after_restart:
        print(json.dumps(run(a.dir, "after restart")))
        sys.exit(0)
    disk_dir = a.dir or tempfile.mkdtemp(prefix="sluice-kv-")
    try:
        first = run(disk_dir, "first run")
        second = subprocess.run([sys.executable, __file__, "--dir", disk_dir, "--after-restart"],
                                capture_output=True, text=True, check=True)
    finally:
        if a.dir is None:  # the temporary tier goes; yours stays for the next run
            shutil.rmtree(disk_dir, ignore_errors=True)
    *lines, answers = second.stdout.strip().splitlines()
    print("\n".join(lines))
    same = json.loads(answers) == first
    print("same answers after the restart:", same)
