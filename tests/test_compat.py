"""``cce_inductor/_compat.py``: transformers' ``logger.warning_once`` is traced through (no graph break between the
head and the loss), and Dynamo's config stays serialisable to ``json`` (torch 2.11 writes it into every
compilation's metrics and logs an error with a traceback on a function in it)."""

import functools
import json
import logging

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import cce_inductor
from cce_inductor import _compat
from tests.support.compare import inductor_caches_off


@pytest.fixture
def warning_once(monkeypatch):
    """``logging.Logger.warning_once`` as transformers defines it (an ``lru_cache``-wrapped function), and Dynamo's
    set of ignored logger methods restored afterwards."""

    @functools.lru_cache(None)
    def warning_once(self, *args, **kwargs):
        pass

    ignored = _compat._ignored_logger_methods()
    before = set(ignored)
    monkeypatch.setattr(logging.Logger, "warning_once", warning_once, raising=False)
    torch._dynamo.reset()
    yield warning_once
    ignored.clear()
    ignored.update(before)
    torch._dynamo.reset()


def _config_json() -> str:
    """What torch 2.11 serialises: the config's sets as lists (its ``clean_for_json``), through ``json``."""
    config = torch._dynamo.config.get_config_copy()
    return json.dumps(
        {
            key: sorted(value) if isinstance(value, set) else value
            for key, value in config.items()
            if key in ("ignore_logger_methods", "ignore_logging_functions")
        }
    )


def test_warning_once_is_traced_through_and_the_config_serialises(warning_once):
    logger = logging.getLogger("cce_inductor.tests.compat")

    def head_and_loss(e, c, t):
        logits = F.linear(e, c)
        logger.warning_once("a one-time warning between the head and the loss")
        return F.cross_entropy(logits.float(), t)

    e, c, t = torch.randn(8, 16), torch.randn(32, 16), torch.randint(0, 32, (8,))
    backend = cce_inductor.make_backend(path="lean")
    torch._dynamo.reset()  # drops the start callback: the entry added by make_backend must carry on
    counter = torch._dynamo.testing.CompileCounter()
    torch.compile(head_and_loss, backend=counter)(e, c, t)
    assert counter.frame_count == 1  # one graph: no break at the warning
    assert warning_once in _compat._ignored_logger_methods()
    assert "warning_once" in _config_json()  # a name, where the function itself fails json
    with pytest.raises(TypeError):
        json.dumps([warning_once])
    torch._dynamo.reset()
    cce_inductor.reset_stats()
    with inductor_caches_off():
        loss = torch.compile(head_and_loss, backend=backend)(e, c, t)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(e, c), t))
    assert cce_inductor.stats()["rewritten"] == 1, cce_inductor.stats()["summary"]


def test_entry_is_added_once_and_compares_as_the_function(warning_once):
    ignored = _compat._ignored_logger_methods()
    _compat.install()
    _compat.install()
    ours = [entry for entry in ignored if entry == warning_once]
    assert len(ours) == 1 and isinstance(ours[0], str)
    assert {warning_once}.intersection(ignored) and warning_once in ignored  # Dynamo's two membership tests
    assert ours[0] != (lambda: None) and ours[0] != str(ours[0])  # equal to that function only
