"""The test suite. A package (as are its subfolders) so that equal file names in two folders do not collide; the
helpers every file shares are in ``tests/support``.

The repository's root is on ``sys.path`` for ``tests.*``: pytest appends it (``--import-mode=append``, pyproject),
and the working directory that ``python -m pytest`` puts first goes behind the installed packages here, so that the
top-level ``kernels/`` folder (``cce_inductor.kernels``, through the install's package-dir mapping) does not shadow
Hugging Face's ``kernels`` distribution, which transformers imports wherever it is installed."""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_AT_ROOT = [entry for entry in sys.path if Path(entry or ".").resolve() == _ROOT]
sys.path[:] = [entry for entry in sys.path if entry not in _AT_ROOT] + _AT_ROOT
