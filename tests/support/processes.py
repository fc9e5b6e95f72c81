"""Fresh Python processes for the tests that need one (autoload at ``import torch``, caches across processes): their
environment, running them, and reading the JSON line they print.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def subprocess_env(cache_dir, caches=False, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCE_INDUCTOR", "TORCHINDUCTOR", "TORCH_COMPILE"))}
    env.pop("PYTHONPATH", None)
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1" if caches else "0",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1" if caches else "0",
        TORCHINDUCTOR_COMPILE_THREADS="1",  # no worker pool to start on a 2-core machine
        PYTHONWARNINGS="default::RuntimeWarning",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(args, env, cwd, timeout=240):
    proc = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stdout
    return json.loads(lines[-1])
