"""The Inductor hook: a ``CustomGraphPass`` for ``config.pre_grad_custom_pass``, and how it is installed.

Inductor caches compiled graphs (FX graph cache, AOTAutograd cache) keyed on, among others, the custom passes'
``uuid()``. Ours covers the package version, the source of every module that decides what the pass does and
every option, and the uuid of a user pass we chain with, so caches stay on and a hit is never stale. A cache
hit skips the pass (the cached code already calls our op by name), so importing ``cce_inductor`` is what a
cached graph needs.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import _compat, diagnostics
from ._version import __version__
from .fx_passes import rewrite_graph
from .options import CCEOptions, resolve

_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def _source_hash() -> str:
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class CCEGraphPass(CustomGraphPass):
    """Runs every pass of ``cce_inductor.fx_passes``; runs ``chained`` (a pass that was installed before) first."""

    def __init__(self, options: CCEOptions | None = None, chained: Any = None) -> None:
        self.options = options or CCEOptions()
        self.chained = chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        _compat.install()
        if self.chained is not None:
            for user_pass in self.chained if isinstance(self.chained, (list, tuple)) else [self.chained]:
                user_pass(graph)
        rewrite_graph(graph, self.options)

    def uuid(self) -> Any | None:
        chained_ids = []
        for user_pass in self.chained if isinstance(self.chained, (list, tuple)) else [self.chained]:
            if user_pass is None:
                continue
            user_uuid = user_pass.uuid() if hasattr(user_pass, "uuid") else None
            if not user_uuid:
                return None  # a pass we cannot key: caching must be bypassed, as Inductor does for it
            chained_ids.append(repr(user_uuid))
        return f"cce_inductor-{__version__}-{_source_hash()}-{self.options.cache_key()}-{'|'.join(chained_ids)}"


def _installed() -> Any:
    return inductor_config.pre_grad_custom_pass


def _find_ours(hook: Any) -> Any | None:
    """Our pass in the hook, or the pass that refuses every compile where ``CCE_INDUCTOR`` could not be honoured
    (``cce_inductor._flag.refuse``): ``enable``, ``disable`` and the backends replace either, keeping its chain."""
    return hook if isinstance(hook, CCEGraphPass) or getattr(hook, "refused", None) else None


def enable(options: CCEOptions | None = None, **overrides: Any) -> CCEGraphPass:
    """Install the pass globally, so that a plain ``torch.compile(model)`` uses it.

    ``options`` default to the ``CCE_INDUCTOR_*`` environment variables; keyword overrides (the fields of
    :class:`CCEOptions`) win. A pass that was already installed in ``pre_grad_custom_pass`` keeps running, before
    ours. Calling ``enable`` again replaces our pass (with the new options) and keeps the chain.
    """
    options = resolve(options, overrides)
    _compat.install()
    current = _installed()
    ours = _find_ours(current)
    chained = ours.chained if ours is not None else current
    graph_pass = CCEGraphPass(options, chained=chained)
    inductor_config.pre_grad_custom_pass = graph_pass
    return graph_pass


def disable() -> None:
    """Remove our pass; a pass that was installed before ``enable`` is put back."""
    ours = _find_ours(_installed())
    if ours is not None:
        inductor_config.pre_grad_custom_pass = ours.chained


def is_enabled() -> bool:
    return isinstance(_installed(), CCEGraphPass)


def stats() -> dict[str, Any]:
    """Which loss sites the pass rewrote and why the others were not, the fused ops' executions, and whether plain
    ``torch.compile`` runs the pass (``stats()["pass"]``); counts over this process (``reset_stats``)."""
    return diagnostics.stats(describe())


def describe() -> tuple[str, str]:
    """Whether plain ``torch.compile`` runs the pass, and why: ``("on" | "off" | "refused", a sentence)``, the sentence
    ``stats()["pass"]``. ``"refused"``: ``CCE_INDUCTOR`` asks for the pass and could not get it."""
    hook = _installed()
    if isinstance(hook, CCEGraphPass):
        return "on", "on for every torch.compile (enable() or CCE_INDUCTOR)"
    if getattr(hook, "refused", None):
        return "refused", f"off: {hook.refused}; every torch.compile raises this until it is fixed"
    flag = os.environ.get("CCE_INDUCTOR")
    return "off", (
        f"off for plain torch.compile (CCE_INDUCTOR is {'unset' if flag is None else repr(flag)} and "
        "enable() is not in effect); on in the compiles that name it: backend=cce_inductor.backend, "
        '"cce" or make_backend()'
    )
