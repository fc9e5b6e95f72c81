"""Dynamo backends: Inductor with the cce_inductor pass on.

torch.compile(model, backend=cce_inductor.backend)
torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True))
torch.compile(model, backend="cce")          # the torch_dynamo_backends entry point; without an install, after
                                             # `import cce_inductor` (register_name)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config as inductor_config

from . import _compat
from .graph_pass import CCEGraphPass, _find_ours
from .options import CCEOptions, resolve


def make_backend(
    options: CCEOptions | None = None,
    *,
    inductor_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Callable:
    """A Dynamo backend compiling with Inductor and the pass. Options: ``options``, else the ``CCE_INDUCTOR_*``
    environment; keyword ``overrides`` (the fields of :class:`CCEOptions`, e.g. ``drop_logits=True``) win."""
    _compat.install()
    resolved = resolve(options, overrides)

    def cce_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None, **kwargs):
        from torch._inductor.compile_fx import compile_fx

        _compat.install()
        current = inductor_config.pre_grad_custom_pass
        ours = _find_ours(current)
        chained = ours.chained if ours is not None else current
        patches = {**mode_patches(mode, options), **(inductor_options or {})}
        patches["pre_grad_custom_pass"] = CCEGraphPass(resolved, chained=chained)
        with inductor_config.patch(patches):
            return compile_fx(gm, example_inputs, **kwargs)

    cce_backend.options = resolved  # type: ignore[attr-defined]
    return cce_backend


def mode_patches(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """Inductor's config for ``torch.compile(..., mode=, options=)``: Dynamo hands a backend other than Inductor
    both as keywords, which Inductor's own wrapper turns into config (``mode="reduce-overhead"``: CUDA graphs)."""
    from torch._inductor import list_mode_options

    return {**(list_mode_options(mode) if mode else {}), **(options or {})}


def backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """Inductor with the pass; options from the ``CCE_INDUCTOR_*`` environment at compile time."""
    return make_backend()(gm, example_inputs, **kwargs)


BACKEND_NAME = "cce"


def register_name() -> None:
    """``backend="cce"`` without an install: an install registers the name through its ``torch_dynamo_backends``
    entry point, which Dynamo loads on first use; a clone on ``PYTHONPATH`` has none, so ``import cce_inductor``
    registers it (registering it beside the entry point would make Dynamo's own registration fail as a duplicate)."""
    from importlib.metadata import entry_points

    if any(entry.name == BACKEND_NAME for entry in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends.registry import register_backend

    try:
        register_backend(backend, name=BACKEND_NAME)
    except AssertionError:  # registered already (this module imported twice)
        pass
