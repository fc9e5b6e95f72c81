"""cce_inductor/_dispatch.py: where the Triton kernels come from, and what a CUDA head says without them."""

import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from cce_inductor import _dispatch

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("triton")


def test_a_checkout_without_an_install_says_how_to_install():
    """The kernels folder is ``cce_inductor.kernels`` through the install's package-dir mapping alone: a checkout put
    on ``sys.path`` without an install fails at import, saying how to install, rather than running another path.
    The editable install's import hook is removed first, so the child sees what such a setup sees."""
    code = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")).lower()]
        for name in [m for m in sys.modules if m.startswith("cce_inductor")]:
            del sys.modules[name]
        sys.path.insert(0, {str(ROOT)!r})
        try:
            import cce_inductor
        except ImportError as exc:
            print(exc)
        print(sys.modules.get("cce_inductor.kernels"))  # the installed mapping would have found it
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pip install --no-deps -e ." in out.stdout and out.stdout.splitlines()[-1] == "None", out.stdout


def test_a_cuda_head_without_kernels_warns_once_and_its_record_says_why(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton_kernels", lambda: None)
    monkeypatch.setattr(_dispatch, "_kernels_error", "ModuleNotFoundError: No module named 'triton'")
    _dispatch._warn_no_kernels.cache_clear()
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _dispatch.uses_kernels(cuda, torch.bfloat16)
        assert not _dispatch.uses_kernels(cuda, torch.float16)
    _dispatch._warn_no_kernels.cache_clear()
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning), [str(w.message) for w in caught]
    assert "No module named 'triton'" in str(caught[0].message) and "chunked PyTorch path" in str(caught[0].message)
    note = _dispatch.no_kernels_note(cuda, torch.bfloat16)
    assert note.startswith("; no Triton kernels on this CUDA device (ModuleNotFoundError: No module named 'triton')")
    assert "chunked PyTorch path runs instead" in note and "pip install" in note
    # nothing to say where the chunked path is the path anyway: the CPU, fp64
    assert _dispatch.no_kernels_note(torch.device("cpu"), torch.bfloat16) == ""
    assert _dispatch.no_kernels_note(cuda, torch.float64) == ""


def test_with_the_kernels_a_cuda_head_uses_them_and_says_nothing():
    assert _dispatch.triton_kernels() is not None and _dispatch._kernels_error == ""
    assert _dispatch.uses_kernels(torch.device("cuda"), torch.bfloat16)
    assert not _dispatch.uses_kernels(torch.device("cuda"), torch.float64)
    assert not _dispatch.uses_kernels(torch.device("cpu"), torch.bfloat16)
    assert _dispatch.no_kernels_note(torch.device("cuda"), torch.bfloat16) == ""


def test_kernels_whose_triton_cannot_import_fall_back_with_the_reason(monkeypatch):
    """The package's constants import without Triton; where the kernels themselves cannot (Triton missing) there are
    no kernels: None and the error, no raise."""

    class NoTriton:
        def __getattr__(self, name):
            raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(_dispatch.importlib, "import_module", lambda name: NoTriton())
    monkeypatch.setattr(_dispatch, "_kernels_error", None)
    _dispatch.triton_kernels.cache_clear()
    try:
        assert _dispatch.triton_kernels() is None
        assert _dispatch._kernels_error == "ModuleNotFoundError: No module named 'triton'"
    finally:
        _dispatch.triton_kernels.cache_clear()
    monkeypatch.undo()
    assert _dispatch.triton_kernels() is not None and _dispatch._kernels_error == ""
