"""cce_inductor: Cut Cross-Entropy for unmodified PyTorch models.

* :func:`linear_cross_entropy` -- the fused op, callable directly.
* :func:`backend` / :func:`make_backend` -- ``torch.compile(model, backend=cce_inductor.backend)``.
* :func:`enable` / :func:`disable` -- the pass for every plain ``torch.compile`` (``CCE_INDUCTOR=1`` does this
  at ``import torch``).
* :func:`stats` -- which loss sites were rewritten and why the others were not.
"""

import importlib as _importlib

try:  # the kernels folder is ``cce_inductor.kernels`` through the install's package-dir mapping alone
    _importlib.import_module(".kernels", __name__)  # (without Triton: the kernels load on first use)
except ModuleNotFoundError as exc:
    raise ImportError(
        "cce_inductor.kernels is not importable: install the package (in a checkout: pip install --no-deps -e .)"
    ) from exc

from . import _compat
from ._dropped_logits import DroppedLogits
from ._lazy_logits import LazyLogits
from ._version import __version__
from .backend import backend, make_backend
from .backend import register_name as _register_name
from .diagnostics import reset_stats
from .functional import linear_cross_entropy
from .graph_pass import CCEGraphPass, disable, enable, is_enabled, stats
from .options import CCEOptions

_compat.install()
_register_name()

from . import _flag  # noqa: E402

_flag.on_package_import()  # the CCE_INDUCTOR flag, applied once the package is whole

__all__ = [
    "__version__",
    "linear_cross_entropy",
    "CCEOptions",
    "DroppedLogits",
    "LazyLogits",
    "backend",
    "make_backend",
    "enable",
    "disable",
    "is_enabled",
    "stats",
    "reset_stats",
    "CCEGraphPass",
]
