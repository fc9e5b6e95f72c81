"""Worker processes for the distributed tests (2 CPU processes, gloo over 127.0.0.1).

One pair of worker processes (``torch.multiprocessing``, spawn) runs the tasks of all selected tests of a test file
in turn (:func:`run_selected_tasks`, called by the file's module fixture ``task_results``); the assertions run inside
the workers, and each test reports its task's outcome (:func:`check_task`: the workers' tracebacks on failure). A
test file lists its tasks in ``_TASKS``: ``name -> (worker function, extra args)``, checked by ``test_<name>``; the
workers stop at the first failure, so cheap tasks go first. The run is bounded (``_SPAWN_TIMEOUT_S``) and every
collective has a timeout (``_PG_TIMEOUT``).

Inductor's FX-graph and AOTAutograd caches are off in the workers so that the pass really runs (a cache hit skips
it and leaves ``stats()`` empty).
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cce_inductor

WORLD = 2
_SPAWN_TIMEOUT_S = 400  # all tasks of a test file together (cold kernel cache: ~2 min on 2 cores)
_PG_TIMEOUT = datetime.timedelta(seconds=90)


# ----------------------------------------------------------------------------------------------------------------
# Process plumbing: one pair of worker processes runs every selected task (process start-up and `import torch`
# cost ~15 s per spawn on 2 cores); each test then checks its own task's outcome.
# ----------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, tasks, result_dir: str) -> None:
    """Worker: join the gloo group on 127.0.0.1, run each ``(name, fn, args)`` task, record ok / traceback."""
    import traceback

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # The pass must run on every rank: a hit in the FX-graph or AOTAutograd cache skips it (and stats() stays
    # empty). The compiled-kernel cache stays on: identical kernels of the DDP and FSDP models compile once.
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    inductor_config.compile_threads = 1
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=_PG_TIMEOUT
    )
    try:
        for name, fn, args in tasks:
            torch._dynamo.reset()
            cce_inductor.reset_stats()
            started = time.monotonic()
            try:
                fn(rank, world, *args)
                dist.barrier()
                outcome = "ok"
            except BaseException:  # noqa: BLE001 - reported to the parent test, then stop (ranks may be out of step)
                outcome = traceback.format_exc()
            with open(os.path.join(result_dir, f"{name}.rank{rank}"), "w") as out:
                out.write(f"{time.monotonic() - started:.1f}\n{outcome}")
            if outcome != "ok":
                os._exit(1)
    finally:
        dist.destroy_process_group()


def _run_tasks(tasks, result_dir: str) -> None:
    """Run the tasks on WORLD spawned processes, bounded in time; outcomes are left in ``result_dir``."""
    context = mp.start_processes(
        _entry, args=(WORLD, _free_port(), tasks, result_dir), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + _SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                _note_workers(result_dir, f"the workers were still running after {_SPAWN_TIMEOUT_S} s")
                break
    except Exception as exc:  # noqa: BLE001 - a worker exited non-zero: its task's outcome file says why, if any
        # a worker that died before writing an outcome (import, gloo rendezvous) is only visible here
        _note_workers(result_dir, f"{type(exc).__name__}: {exc}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def _note_workers(result_dir: str, text: str) -> None:
    with open(os.path.join(result_dir, "_workers"), "w") as out:
        out.write(text)


def run_selected_tasks(request, tmp_path_factory, all_tasks: dict) -> dict:
    """For a test file's module fixture ``task_results``: runs the tasks of ``all_tasks`` (its ``_TASKS``) whose
    tests are selected, once; returns ``name -> outcome of rank 0 / 1``."""
    selected = {item.originalname or item.name for item in request.session.items if item.module is request.module}
    tasks = [(name, fn, args) for name, (fn, args) in all_tasks.items() if f"test_{name}" in selected]
    result_dir = str(tmp_path_factory.mktemp("dist_results"))
    _run_tasks(tasks, result_dir)
    workers_path = os.path.join(result_dir, "_workers")
    workers = ""
    if os.path.exists(workers_path):
        with open(workers_path) as f:
            workers = f.read()
    results = {}
    for name, _, _ in tasks:
        results[name] = []
        for rank in range(WORLD):
            path = os.path.join(result_dir, f"{name}.rank{rank}")
            if os.path.exists(path):
                with open(path) as f:
                    results[name].append(f.read().split("\n", 1)[1])
            else:
                results[name].append(f"not run (an earlier task failed or the workers timed out)\n{workers}")
    return results


def check_task(task_results, name: str) -> None:
    """Fail with the workers' tracebacks unless task ``name`` passed on every rank."""
    outcomes = task_results[name]
    failures = [f"rank {rank}:\n{outcome}" for rank, outcome in enumerate(outcomes) if outcome != "ok"]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
