"""Small accommodations for code people compile, kept in one place."""

from __future__ import annotations

import logging

import torch

def _ignore_warning_once(*_args, **_kwargs) -> None:
    """Let Dynamo trace through ``logger.warning_once`` (defined by transformers on ``logging.Logger``).

    Unhandled, that call is a graph break -- and in transformers' ``loss_function`` it falls between the
    ``lm_head`` and the loss, so the logits reach the loss as a graph input and the site cannot be rewritten.
    Ignoring it inside compiled code only skips a one-time warning, which eager code prints anyway.
    """
    warning_once = getattr(logging.Logger, "warning_once", None)
    if warning_once is None:
        return
    config = torch._dynamo.config
    # `ignore_logger_methods` first: Dynamo leaves it out of the config it serialises into compile metrics
    # (torch 2.11 does not for `ignore_logging_functions`, and logs a JSON error per compile); in 2.13 the
    # two names are one setting.
    ignored = getattr(config, "ignore_logger_methods", None)
    if ignored is None:
        ignored = getattr(config, "ignore_logging_functions", None)
    if ignored is not None and warning_once not in ignored:
        ignored.add(warning_once)


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
