"""The ``CCE_INDUCTOR`` flag (``cce_inductor/_flag.py``, applied through ``cce_inductor_autoload.py`` at ``import
torch``): on for 1 / true / yes / on (any case), off for 0 / false /
no / off / unset, and never silent otherwise: a value that is neither, a bad ``CCE_INDUCTOR_*`` option or a broken
install warns once at ``import torch`` and makes every ``torch.compile`` raise the reason, which ``stats()`` gives
too. Also the ways the flag is applied when torch does not apply it: ``import cce_inductor`` before ``import torch``,
and a package whose entry points are missing (``backend="cce"`` and the flag work from ``import cce_inductor``).

Subprocess tests (``slow``) run a fresh interpreter per case; the in-process ones put the refusing pass in the hook.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

import cce_inductor
from cce_inductor import _flag
from tests.support.processes import last_json, run_python, subprocess_env

REPO = Path(__file__).resolve().parents[1]

# Our entry points hidden: none exists for torch or Dynamo to load (an install without its metadata).
_HIDE_OUR_ENTRY_POINTS = """
import importlib.metadata as metadata
_entry_points = metadata.entry_points
def _without_ours(**selection):
    found = _entry_points(**selection)
    if not selection:  # all groups (torch and Dynamo select one)
        return found
    return metadata.EntryPoints(e for e in found if not e.value.startswith("cce_inductor"))
metadata.entry_points = _without_ours
"""

FLAG_SCRIPT = """
import json
import sys

if sys.argv[1] == "clone":
    exec(HIDE)
if sys.argv[1] == "package_first":
    import cce_inductor
import torch
import torch.nn.functional as F

import cce_inductor


def head_loss(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


inputs = (torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,)))
result = {"pass": cce_inductor.stats()["pass"], "enabled": cce_inductor.is_enabled()}
try:
    torch.compile(head_loss, backend=sys.argv[2] if len(sys.argv) > 2 else "inductor")(*inputs)
    result["error"] = None
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
result["rewritten"] = cce_inductor.stats()["rewritten"]
result["summary"] = cce_inductor.stats()["summary"]
print(json.dumps(result))
"""


def _run_flag_script(tmp_path, cache_dir, how="torch_first", *backend, **env):
    script = tmp_path / "flag.py"
    script.write_text(FLAG_SCRIPT.replace("exec(HIDE)", f"exec({_HIDE_OUR_ENTRY_POINTS!r})"))
    proc = run_python([str(script), how, *backend], subprocess_env(cache_dir, **env), tmp_path)
    warnings = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    return last_json(proc.stdout), warnings


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("inductor_cache")


# ----------------------------------------------------------------------------------------------------------------
# Values that cannot be honoured: one warning at import torch, then every compile stops with the reason
# ----------------------------------------------------------------------------------------------------------------

BAD = [
    ({"CCE_INDUCTOR": "1", "CCE_INDUCTOR_SCRATCH_MB": "abc"}, "CCE_INDUCTOR_SCRATCH_MB='abc' is not an integer"),
    ({"CCE_INDUCTOR": "1", "CCE_INDUCTOR_PATH": "fast"}, "CCE_INDUCTOR_PATH='fast': path must be"),
    ({"CCE_INDUCTOR": "1", "CCE_INDUCTOR_EXACT": "maybe"}, "CCE_INDUCTOR_EXACT='maybe' is not a boolean"),
    (
        {"CCE_INDUCTOR": "1", "CCE_INDUCTOR_PATHS": "lean"},
        "unknown cce_inductor environment option(s) ['CCE_INDUCTOR_PATHS']",
    ),
    ({"CCE_INDUCTOR": "2"}, "CCE_INDUCTOR='2' is neither on (1, true, yes, on) nor off"),
    ({"CCE_INDUCTOR": "enable"}, "CCE_INDUCTOR='enable' is neither on"),
]


@pytest.mark.slow
@pytest.mark.parametrize("env, message", BAD, ids=[",".join(f"{k}={v}" for k, v in e.items()) for e, _ in BAD])
def test_a_flag_that_cannot_be_honoured_stops_the_first_compile(tmp_path, cache_dir, env, message):
    result, warnings = _run_flag_script(tmp_path, cache_dir, **env)
    assert len(warnings) == 1 and message in warnings[0], warnings
    assert result["error"] is not None and result["error"].startswith("BackendCompilerFailed"), result
    assert message in result["error"] and "torch.compile stops here" in result["error"], result["error"]
    assert not result["enabled"]
    assert result["pass"].startswith("off: ") and message in result["pass"], result["pass"]
    assert result["summary"].startswith("the pass is off: ") and message in result["summary"], result["summary"]


@pytest.mark.slow
def test_a_broken_install_stops_the_first_compile(tmp_path, cache_dir):
    fake = tmp_path / "fake" / "cce_inductor"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    script = tmp_path / "broken.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "f = torch.compile(lambda h, w, y: F.cross_entropy(F.linear(h, w), y))\n"
        "try:\n"
        "    f(torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,)))\n"
        "except Exception as exc:\n"
        "    print('STOPPED', type(exc).__name__, exc)\n"
    )
    env = subprocess_env(cache_dir, CCE_INDUCTOR="1", PYTHONPATH=f"{tmp_path / 'fake'}:{REPO}")
    proc = run_python([str(script)], env, tmp_path)
    assert "could not be enabled (ImportError: simulated broken install)" in proc.stderr, proc.stderr
    assert "STOPPED BackendCompilerFailed" in proc.stdout and "simulated broken install" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------------------------------------------
# Values that turn it on, whatever comes first, installed or not
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("value", [" Yes ", "TRUE"])
def test_on_values_any_case(tmp_path, cache_dir, value):
    result, warnings = _run_flag_script(tmp_path, cache_dir, CCE_INDUCTOR=value)
    assert not warnings, warnings
    assert result["enabled"] and result["error"] is None and result["rewritten"] == 1, result


@pytest.mark.slow
def test_import_cce_inductor_before_torch(tmp_path, cache_dir):
    """``import cce_inductor`` imports torch, which calls the entry point while the package is half imported: the
    flag is applied when the import ends (it was lost before, to a warning about a circular import)."""
    result, warnings = _run_flag_script(tmp_path, cache_dir, "package_first", CCE_INDUCTOR="1")
    assert not warnings, warnings
    assert result["enabled"] and result["error"] is None and result["rewritten"] == 1, result
    assert result["pass"].startswith("on for every torch.compile"), result["pass"]


@pytest.mark.slow
def test_clone_on_pythonpath_flag_applied_at_import_with_a_warning(tmp_path, cache_dir):
    result, warnings = _run_flag_script(tmp_path, cache_dir, "clone", CCE_INDUCTOR="1", PYTHONPATH=str(REPO))
    assert len(warnings) == 1 and "was not read at `import torch`" in warnings[0], warnings
    assert result["enabled"] and result["error"] is None and result["rewritten"] == 1, result


@pytest.mark.slow
def test_clone_on_pythonpath_backend_by_name(tmp_path, cache_dir):
    result, warnings = _run_flag_script(tmp_path, cache_dir, "clone", "cce", PYTHONPATH=str(REPO))
    assert not warnings, warnings
    assert not result["enabled"] and result["error"] is None and result["rewritten"] == 1, result


# ----------------------------------------------------------------------------------------------------------------
# In process: the refusing pass in the hook, and what replaces it
# ----------------------------------------------------------------------------------------------------------------


def _head_loss(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def _inputs():
    return torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,))


def test_refusing_pass_stops_compiles_until_enable_or_disable(no_inductor_caches, clean_env, restore_hook):
    inductor_config.pre_grad_custom_pass = None
    refusing = _flag._refusing_pass("CCE_INDUCTOR='2' is neither on nor off", None)
    inductor_config.pre_grad_custom_pass = refusing
    assert refusing.uuid() != _flag._refusing_pass("same", None).uuid()  # caches never skip it
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="CCE_INDUCTOR='2' is neither on nor off"):
        torch.compile(_head_loss)(*_inputs())
    stats = cce_inductor.stats()
    assert stats["pass"] == (
        "off: CCE_INDUCTOR='2' is neither on nor off; every torch.compile raises this until it is fixed"
    )
    assert stats["summary"].startswith("the pass is off: CCE_INDUCTOR='2'"), stats["summary"]
    assert not cce_inductor.is_enabled()

    # a backend names its pass: the refusal is not chained into it
    torch._dynamo.reset()
    torch.compile(_head_loss, backend=cce_inductor.backend)(*_inputs())
    assert cce_inductor.stats()["rewritten"] == 1

    ours = cce_inductor.enable()  # enable() decides in the flag's place: the refusal goes, not chained
    assert ours.chained is None and cce_inductor.is_enabled()
    cce_inductor.disable()
    assert inductor_config.pre_grad_custom_pass is None
    inductor_config.pre_grad_custom_pass = refusing
    cce_inductor.disable()  # and disable() too
    assert inductor_config.pre_grad_custom_pass is None
    torch._dynamo.reset()
    torch.compile(_head_loss)(*_inputs())


def test_stats_says_when_the_pass_is_off_for_plain_compiles(clean_env, restore_hook, monkeypatch):
    inductor_config.pre_grad_custom_pass = None
    stats = cce_inductor.stats()
    assert stats["pass"].startswith("off for plain torch.compile (CCE_INDUCTOR is unset"), stats["pass"]
    assert stats["summary"].startswith("the pass has not seen any graph: it is off for plain torch.compile"), stats
    monkeypatch.setenv("CCE_INDUCTOR", "0")
    assert "(CCE_INDUCTOR is '0' and enable() is not in effect)" in cce_inductor.stats()["pass"]
    cce_inductor.enable()
    try:
        assert cce_inductor.stats()["pass"] == "on for every torch.compile (enable() or CCE_INDUCTOR)"
        assert cce_inductor.stats()["summary"].startswith("the pass has not seen any graph (nothing was compiled")
    finally:
        cce_inductor.disable()
