"""The ``CCE_INDUCTOR`` flag: the cce_inductor pass for every plain ``torch.compile``, with no code change.

``CCE_INDUCTOR`` is on for ``1``, ``true``, ``yes``, ``on`` and off for ``0``, ``false``, ``no``, ``off`` or unset (any
case, surrounding blanks ignored); any other value is an error. It is applied by :func:`on_package_import`, at the end
of ``import cce_inductor``: the ``torch.backends`` entry point of an install (``cce_inductor_autoload``, at the end
of ``import torch``) imports this package to that end, and where torch did not load it (a clone on ``PYTHONPATH``
has no entry point, ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` skips them) the flag is applied all the same, with a warning.

It never fails quietly: where the flag cannot be honoured (a value that is neither on nor off, a bad
``CCE_INDUCTOR_*`` option) it warns once and puts in the pass's place one that raises the same message at every
compile (:func:`refuse`), so that no run trains without the pass it asked for; ``cce_inductor.stats()["pass"]`` says
why the pass is off. (An install whose package cannot be imported at all is refused by the entry point itself.)
"""

import os
import sys

ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")

# What the flag did in this process: "" (not applied yet), "on", "off", or why the pass is off although it is set.
state = ""


def _called_by_torch() -> bool:
    """Whether torch ran our ``torch.backends`` entry point (``cce_inductor_autoload``, which marks itself; read from
    ``sys.modules``, as the entry point imports this package and not the other way round)."""
    return bool(getattr(sys.modules.get("cce_inductor_autoload"), "called_by_torch", False))


def on_package_import() -> None:
    """The end of ``import cce_inductor``: apply the flag (module docstring), once per process."""
    if state or _flag() in OFF:
        return
    if not _called_by_torch():
        import warnings

        warnings.warn(
            f"CCE_INDUCTOR={_raw()!r} was not read at `import torch`: no installed cce_inductor provides its entry "
            "point (a clone on PYTHONPATH), or TORCH_DEVICE_BACKEND_AUTOLOAD=0; it is applied now, at `import "
            "cce_inductor`, and graphs compiled before ran without the pass. Installed (pip install -e <clone>), "
            "the flag needs no import.",
            RuntimeWarning,
            stacklevel=3,
        )
    apply()


def apply() -> None:
    """Enable the pass as the flag says, or :func:`refuse` with the reason; once per process."""
    global state
    if state:
        return
    flag = _flag()
    if flag in OFF:
        state = "off"
        return
    if flag not in ON:
        refuse(f"CCE_INDUCTOR={_raw()!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF[1:])}, or unset)")
        return
    try:
        from .graph_pass import enable

        enable()
    except Exception as exc:  # noqa: BLE001 - a bad option value (or any failure) refuses, loudly
        refuse(f"CCE_INDUCTOR={_raw()!r} is set but cce_inductor could not be enabled ({type(exc).__name__}: {exc})")
        return
    state = "on"


def refuse(reason: str) -> None:
    """Warn once, and make every compile raise ``reason`` until the pass is enabled or disabled explicitly."""
    global state
    state = reason
    import warnings

    warnings.warn(f"{reason}; every torch.compile raises this until it is fixed", RuntimeWarning, stacklevel=2)
    try:
        import torch._inductor.config as inductor_config

        inductor_config.pre_grad_custom_pass = _refusing_pass(reason, inductor_config.pre_grad_custom_pass)
    except Exception as exc:  # noqa: BLE001 - a torch without Inductor compiles nothing the pass could see
        warnings.warn(
            f"cce_inductor could not stop torch.compile ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3
        )


def _refusing_pass(reason: str, chained):
    """A pre-grad pass that raises ``reason``. Its class is made here, on first use, because importing
    ``torch._inductor`` at module level would cost every ``import torch``."""
    import uuid

    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RefusingPass(CustomGraphPass):
        def __init__(self) -> None:
            self.refused = reason  # cce_inductor.enable / disable and its backends replace this pass like their own
            self.chained = chained
            self._uuid = uuid.uuid4().hex  # never the same twice: no cache entry can skip the raise

        def __call__(self, graph) -> None:
            raise RuntimeError(
                f"cce_inductor: {reason}. torch.compile stops here instead of compiling without the pass that "
                "CCE_INDUCTOR asks for: fix the value, or unset CCE_INDUCTOR (cce_inductor.enable() / disable() "
                "decide in its place for this process)."
            )

        def uuid(self) -> str:
            return self._uuid

    return RefusingPass()


def _raw() -> str:
    return os.environ.get("CCE_INDUCTOR", "")


def _flag() -> str:
    return _raw().strip().lower()
