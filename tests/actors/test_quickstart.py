"""The README's snippet, as a user runs it: no ray.init of their own, defaults elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

SCRIPT = """
import torch
from cluster import CacheConfig, ModelSpec, start, connect, stop

info = start(CacheConfig(page_tokens=16, host_bytes=8 << 20, device_bytes=1 << 20,
                         disk_bytes=8 << 20, disk_dir={disk_dir!r}))
assert start(CacheConfig(page_tokens=16, host_bytes=8 << 20, device_bytes=1 << 20,
                         disk_bytes=8 << 20, disk_dir={disk_dir!r}))["nodes"] == info["nodes"]
client = connect(ModelSpec.preset("tiny-llama"))
tokens = list(range(40))
kv = torch.randn(2, 2, 2, 40, 16)
assert client.put(tokens, kv) == 32
assert client.lookup(tokens) == 32
n, got = client.get(tokens)
assert n == 32 and torch.equal(got, kv[:, :, :, :32])
try:
    start(CacheConfig(page_tokens=32, disk_dir={disk_dir!r}))
    raise SystemExit("a second start with another config must be refused")
except ValueError as error:
    assert "different CacheConfig" in str(error)
stop()
print("quickstart ok", len(info["nodes"]))
"""


def test_readme_snippet_runs_on_a_fresh_local_ray():
    disk_dir = tempfile.mkdtemp(prefix="raykv-quickstart-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        result = subprocess.run([sys.executable, "-c", SCRIPT.format(disk_dir=disk_dir)],
                                capture_output=True, text=True, timeout=300, env=env)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "quickstart ok 1" in result.stdout
