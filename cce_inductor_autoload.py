"""``torch.backends`` entry point: the ``CCE_INDUCTOR`` flag at ``import torch``.

Torch calls :func:`autoload` at the end of ``import torch``. With the flag unset or off this costs nothing (no import
beyond ``os``); otherwise it imports ``cce_inductor``, whose import ends by applying the flag
(``cce_inductor/_flag.py``: the accepted values, the pass enabled or refused with the reason). It never breaks
``import torch``: an install whose package cannot be imported warns and makes every ``torch.compile`` raise the
reason, so that no run trains without the pass it asked for.

It lives outside the ``cce_inductor`` package because importing that package imports torch, which is still being
imported when this runs.
"""

import os

# Set by autoload(): the package reads it (from sys.modules) to know that torch ran this entry point.
called_by_torch = False


def autoload() -> None:
    global called_by_torch
    called_by_torch = True
    if os.environ.get("CCE_INDUCTOR", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    try:
        import cce_inductor  # noqa: F401 - its import applies the flag (cce_inductor/_flag.py)
    except Exception as exc:  # noqa: BLE001 - anything raised here would abort `import torch`
        _refuse(
            f"CCE_INDUCTOR={os.environ['CCE_INDUCTOR']!r} is set but cce_inductor could not be enabled "
            f"({type(exc).__name__}: {exc})"
        )


def _refuse(reason: str) -> None:
    """Warn once, and put a pre-grad pass that raises ``reason`` in Inductor's hook (the package cannot: it does not
    import)."""
    import warnings

    warnings.warn(f"{reason}; every torch.compile raises this until it is fixed", RuntimeWarning, stacklevel=2)

    def refusing_pass(graph) -> None:
        raise RuntimeError(
            f"cce_inductor: {reason}. torch.compile stops here instead of compiling without the pass "
            "that CCE_INDUCTOR asks for: fix the install, or unset CCE_INDUCTOR."
        )

    refusing_pass.refused = reason
    try:
        import torch._inductor.config as inductor_config

        inductor_config.pre_grad_custom_pass = refusing_pass
    except Exception as exc:  # noqa: BLE001 - a torch without Inductor compiles nothing the pass could see
        warnings.warn(
            f"cce_inductor could not stop torch.compile ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3
        )
