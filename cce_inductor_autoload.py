"""``torch.backends`` entry point: turns the cce_inductor pass on for plain ``torch.compile`` when ``CCE_INDUCTOR=1``.

Torch calls :func:`autoload` at the end of ``import torch``. Two rules follow:

* With the flag unset this must cost nothing: no import beyond ``os``.
* It must never break ``import torch``: any failure becomes a warning and torch carries on without the pass.

It lives outside the ``cce_inductor`` package because importing that package imports torch, which is still
being imported when this runs.
"""

import os

_TRUTHY = ("1", "true", "yes", "on")


def autoload() -> None:
    if os.environ.get("CCE_INDUCTOR", "").strip().lower() not in _TRUTHY:
        return
    try:
        import cce_inductor

        cce_inductor.enable()
    except Exception as exc:  # noqa: BLE001 - anything here would abort `import torch`
        import warnings

        warnings.warn(
            f"CCE_INDUCTOR=1 is set but cce_inductor could not be enabled ({type(exc).__name__}: {exc}); "
            "torch.compile will run without the fused linear-cross-entropy pass.",
            RuntimeWarning,
            stacklevel=1,
        )
