"""The kernels are a library below the package: they take their plans as explicit arguments and import nothing from
``cce_inductor`` (the package reads the kernels' layout table, ``kernels/_layout.py``, never the other way), so that
the folder can be read, tested and changed on its own."""

import ast
import pathlib

import pytest

import cce_inductor.kernels

KERNELS = pathlib.Path(cce_inductor.kernels.__path__[0])
SOURCES = sorted(KERNELS.glob("*.py"))


def imported_names(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for every import of a module: absolute names, relative ones as written (leading dots), and the
    string literals given to ``importlib.import_module`` / ``__import__``."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names.append((node.lineno, str(node.args[0].value)))
    return names


def imports_from_above(tree: ast.Module) -> list[tuple[int, str]]:
    return [
        (line, name) for line, name in imported_names(tree) if name.split(".")[0] == "cce_inductor" or name[:2] == ".."
    ]


def test_the_kernels_folder_is_found():
    assert {"__init__.py", "_layout.py", "_launch.py", "_balanced_launch.py"} <= {path.name for path in SOURCES}


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.name)
def test_a_kernel_module_imports_nothing_above_its_folder(source):
    above = imports_from_above(ast.parse(source.read_text(), str(source)))
    assert not above, f"kernels/{source.name} imports from the package above it: {above}"


def test_the_check_sees_an_import_back():
    """The test above would fail on each spelling of an import from the package."""
    spellings = [
        "from cce_inductor import paths",
        "import cce_inductor._planning",
        "from .. import paths",
        "importlib.import_module('cce_inductor.paths')",
    ]
    for spelling in spellings:
        assert imports_from_above(ast.parse(spelling)), spelling
    assert not imports_from_above(ast.parse("from . import _launch\nimportlib.import_module('._forward', __name__)"))
