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


def test_a_source_checkout_on_the_path_imports_its_kernels():
    """Without an install (no package-dir mapping of ``cce_inductor.kernels``, e.g. a checkout on PYTHONPATH on a GPU
    machine) the checkout's ``kernels/`` folder is loaded under that name, rather than the chunked path running
    silently. The editable install's import hook is removed first, so the child sees what such a setup sees."""
    code = textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")).lower()]
        for name in [m for m in sys.modules if m.startswith("cce_inductor")]:
            del sys.modules[name]
        sys.path.insert(0, {str(ROOT)!r})
        import importlib.util
        assert importlib.util.find_spec("cce_inductor.kernels") is None, "the mapping is still installed"
        import torch, cce_inductor
        from cce_inductor import _dispatch
        kernels = _dispatch.triton_kernels()
        print(kernels.__name__, kernels.__file__, repr(_dispatch._kernels_error))
        print(sys.modules["cce_inductor.kernels"] is kernels, cce_inductor.kernels is kernels)
        print(_dispatch.uses_kernels(torch.device("cuda"), torch.bfloat16))
        print(kernels.forward.__module__)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    name, path, error = lines[0].split(" ")
    assert name == "cce_inductor.kernels" and pathlib.Path(path) == ROOT / "kernels" / "__init__.py", lines
    assert error == "''", lines
    assert lines[1] == "True True" and lines[2] == "True", lines
    assert lines[3].startswith("cce_inductor.kernels."), lines


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


def test_a_top_level_kernels_folder_elsewhere_is_not_taken_for_ours(tmp_path, monkeypatch):
    """In site-packages a top-level ``kernels`` is an unrelated distribution: the loader takes the folder beside the
    package only in our own checkout (a ``pyproject.toml`` beside it, our ``kernels/_balanced.py`` in it)."""
    package = tmp_path / "cce_inductor"
    package.mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("raise AssertionError('loaded an unrelated kernels package')\n")
    monkeypatch.setattr(_dispatch, "__file__", str(package / "_dispatch.py"))
    assert _dispatch._checkout_kernels("cce_inductor.kernels") is None
    (tmp_path / "pyproject.toml").write_text("")
    assert _dispatch._checkout_kernels("cce_inductor.kernels") is None  # a pyproject.toml, but not our kernels


def test_a_checkout_whose_kernels_cannot_import_falls_back_with_the_reason(monkeypatch):
    """The checkout's own load failing (Triton missing) is the same as no kernels: None and the error, no raise."""

    def no_triton(name):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(_dispatch.importlib, "import_module", missing)
    monkeypatch.setattr(_dispatch, "_checkout_kernels", no_triton)
    monkeypatch.setattr(_dispatch, "_kernels_error", None)
    _dispatch.triton_kernels.cache_clear()
    try:
        assert _dispatch.triton_kernels() is None
        assert _dispatch._kernels_error == "ModuleNotFoundError: No module named 'triton'"
    finally:
        _dispatch.triton_kernels.cache_clear()
    monkeypatch.undo()
    assert _dispatch.triton_kernels() is not None and _dispatch._kernels_error == ""
