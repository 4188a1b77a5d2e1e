"""Starting ``n`` ranks of ``worker.py`` on this machine (gloo on the CPU, one thread each) and
waiting for them, with a bound on the whole run."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, options: dict, out: Path, timeout: float = 300, extra_env=None, script: str = "worker.py"):
    """Run ``world`` ranks; returns ``[(returncode, stderr)]`` per rank."""
    port = free_port()
    processes = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT), **(extra_env or {})}
        processes.append(subprocess.Popen(
            [sys.executable, str(HERE / script), json.dumps(options), str(out)], cwd=str(ROOT), env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    results = []
    for process in processes:
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append((process.returncode, err))
    return results
