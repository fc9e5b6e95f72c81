"""The ``CCE_INDUCTOR`` flag: the cce_inductor pass for every plain ``torch.compile``, with no code change.

``CCE_INDUCTOR`` is on for ``1``, ``true``, ``yes``, ``on`` and off for ``0``, ``false``, ``no``, ``off`` or unset (any
case, surrounding blanks ignored); any other value is an error. Where it is applied:

* :func:`autoload`, the ``torch.backends`` entry point of an install, at the end of ``import torch``;
* :func:`on_package_import`, at the end of ``import cce_inductor``, where torch did not apply it: a clone on
  ``PYTHONPATH`` has no entry point, ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` skips them (both say so in a warning), and
  where ``import cce_inductor`` comes first torch calls the entry point while the package is half imported.

The rules:

* With the flag unset or off this costs nothing: no import beyond ``os``.
* It never breaks ``import torch``, and it never fails quietly: where the flag cannot be honoured (a value that is
  neither on nor off, a bad ``CCE_INDUCTOR_*`` option, a broken install) it warns once and puts in the pass's place
  one that raises the same message at every compile (:func:`refuse`), so that no run trains without the pass it
  asked for; ``cce_inductor.stats()["pass"]`` says why the pass is off.

It lives outside the ``cce_inductor`` package because importing that package imports torch, which is still
being imported when :func:`autoload` runs.
"""

import os

ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")

# What the flag did in this process: "" (not applied yet), "on", "off", or why the pass is off although it is set.
state = ""
_called_by_torch = False
_applying = False  # apply() is importing cce_inductor, whose on_package_import must leave the flag to it


def autoload() -> None:
    """The ``torch.backends`` entry point (called by ``import torch``)."""
    global _called_by_torch
    _called_by_torch = True
    if _flag() not in OFF:
        apply()


def on_package_import() -> None:
    """The end of ``import cce_inductor``: apply the flag where torch did not (module docstring)."""
    if state or _applying or _flag() in OFF:
        return
    if not _called_by_torch:
        import warnings

        warnings.warn(
            f"CCE_INDUCTOR={_raw()!r} was not read at `import torch`: no installed cce_inductor provides its entry "
            "point (a clone on PYTHONPATH), or TORCH_DEVICE_BACKEND_AUTOLOAD=0; it is applied now, at `import "
            "cce_inductor`, and graphs compiled before ran without the pass. Installed (pip install -e <clone>), "
            "the flag needs no import.",
            RuntimeWarning,
            stacklevel=3,
        )
    apply(package_ready=True)


def apply(package_ready: bool = False) -> None:
    """Enable the pass as the flag says, or :func:`refuse` with the reason; once per process."""
    global state, _applying
    if state or _applying:
        return
    flag = _flag()
    if flag in OFF:
        state = "off"
        return
    if flag not in ON:
        refuse(f"CCE_INDUCTOR={_raw()!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF[1:])}, or unset)")
        return
    import sys

    if "cce_inductor" in sys.modules and not package_ready and not getattr(sys.modules["cce_inductor"], "_ready", True):
        return  # `import cce_inductor` is under way (it imports torch): on_package_import applies the flag
    _applying = True
    try:
        import cce_inductor

        cce_inductor.enable()
    except Exception as exc:  # noqa: BLE001 - anything raised here would abort `import torch`
        refuse(f"CCE_INDUCTOR={_raw()!r} is set but cce_inductor could not be enabled ({type(exc).__name__}: {exc})")
        return
    finally:
        _applying = False
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
        warnings.warn(f"cce_inductor could not stop torch.compile ({type(exc).__name__}: {exc})", RuntimeWarning,
                      stacklevel=3)


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
