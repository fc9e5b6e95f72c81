"""Small accommodations for code people compile, kept in one place."""

from __future__ import annotations

import logging

import torch


class _ConfigEntry(str):
    """A function as Dynamo's ``ignore_logger_methods`` holds it for us: equal to the function and hashed like it
    (Dynamo's membership test), and a string (its qualified name) to ``json``: torch 2.11 serialises that config into
    every compilation's metrics and logs an error with a traceback on a function in it (seen on the device's torch
    2.11 under transformers' Trainer; later versions leave the setting out)."""

    fn: object

    def __new__(cls, fn):
        entry = super().__new__(cls, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}")
        entry.fn = fn
        return entry

    def __eq__(self, other) -> bool:
        return other is self.fn or (isinstance(other, _ConfigEntry) and other.fn is self.fn)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.fn)

    # copies (Dynamo deep-copies its config to log and to restore it) and pickles stay the function's entry
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return _ConfigEntry, (self.fn,)


def _ignored_logger_methods():
    """Dynamo's set of logger methods it traces through as no-ops (its name moved between torch versions)."""
    config = torch._dynamo.config
    ignored = getattr(config, "ignore_logger_methods", None)
    return ignored if ignored is not None else getattr(config, "ignore_logging_functions", None)


def _ignore_warning_once(*_args, **_kwargs) -> None:
    """Let Dynamo trace through ``logger.warning_once`` (defined by transformers on ``logging.Logger``).

    Unhandled, that call is a graph break -- and in transformers' ``loss_function`` it falls between the
    ``lm_head`` and the loss, so the logits reach the loss as a graph input and the site cannot be rewritten.
    Ignoring it inside compiled code only skips a one-time warning, which eager code prints anyway.
    """
    warning_once = getattr(logging.Logger, "warning_once", None)
    ignored = _ignored_logger_methods()
    if warning_once is not None and ignored is not None and warning_once not in ignored:
        ignored.add(_ConfigEntry(warning_once))


def install() -> None:
    """Apply the accommodations now and before every Dynamo compilation (transformers may be imported later).

    Idempotent and cheap; called on import and from every entry point, because ``torch._dynamo.reset()``
    drops compile-start callbacks.
    """
    _ignore_warning_once()
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    start_callbacks = getattr(callback_handler, "start_callbacks", None)
    if start_callbacks is None or _ignore_warning_once not in start_callbacks:
        callback_handler.register_start_callback(_ignore_warning_once)
