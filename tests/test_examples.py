"""The examples (``examples/``) run as their README tells a new user to run them, on the CPU: each in its own
process, from the repository root, and each says that its loss was rewritten and what it checked against eager."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.processes import run_python, subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path) -> str:
    # Inductor's caches off: the pass runs in every example, so its summary counts the site
    return run_python(args, subprocess_env(tmp_path / "inductor"), ROOT, timeout=600).stdout


def _close(text: str, pattern: str) -> tuple[float, float]:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return float(match.group(1)), float(match.group(2))


@pytest.mark.slow
def test_train_tiny_lm(tmp_path):
    out = _run(["examples/train_tiny_lm.py", "--device", "cpu"], tmp_path)
    assert "rewrote 1 of 1 loss sites" in out, out


@pytest.mark.slow
def test_hf_llama(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    out = _run(["examples/hf_llama.py", "--device", "cpu"], tmp_path)
    assert "rewrote 1 of 1 loss sites" in out and "outputs.logits is a LazyLogits" in out, out
    losses = [float(x) for x in re.findall(r"step \d+ +loss ([0-9.]+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0], out  # it memorises its one batch
    accuracy, difference = _close(out, r"lazy logits: ([0-9.]+); .* logits: ([0-9.e+-]+)")
    assert accuracy > 0.5 and difference < 1e-4, out  # fp32 on the CPU: the lazy logits are the model's


@pytest.mark.slow
def test_rl_grpo(tmp_path):
    out = _run(["examples/rl_grpo.py", "--device", "cpu"], tmp_path)
    assert "rewrote 1 of 1 loss sites" in out, out
    ours, eager = _close(out, r"loss ([+-]?[0-9.]+) vs ([+-]?[0-9.]+)")
    assert abs(ours - eager) <= 1e-5 * max(1.0, abs(eager)), out
    assert float(re.search(r"gradient relative difference ([0-9.e+-]+)", out).group(1)) < 1e-4, out


@pytest.mark.slow
def test_distributed(tmp_path):
    # torchrun, as the README launches it (python -m torch.distributed.run is the same entry point)
    out = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/distributed.py",
            "--device",
            "cpu",
        ],
        tmp_path,
    )
    assert out.count("rewrote 1 of 1 loss sites") == 2, out  # DDP: each rank
    for rank in (0, 1):
        ours, whole = _close(
            out,
            rf"\[tp\] rank {rank}: .* loss ([0-9.]+) \(F.cross_entropy on the whole head: "
            r"([0-9.]+)\)",
        )
        assert abs(ours - whole) <= 1e-5 * whole, out
