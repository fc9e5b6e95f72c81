"""Tests of ``CCEOptions`` (``cce_inductor/options.py``): built from keywords and from the ``CCE_INDUCTOR_*``
environment (bad values fail loudly, retired ones are reported, every field has a variable), encoded for the op and
decoded, and part of the pass's cache key: every option, from keywords or from the environment, changes
``CCEGraphPass.uuid()`` (no two options may cancel out in it).
"""

from __future__ import annotations

import dataclasses

import pytest

import cce_inductor
from cce_inductor.graph_pass import CCEGraphPass
from cce_inductor.options import CCEOptions

# ----------------------------------------------------------------------------------------------------------------
# Caches: every option is part of the pass's uuid
# ----------------------------------------------------------------------------------------------------------------


def _alternatives(field: dataclasses.Field) -> list:
    """Values other than the default for one CCEOptions field; unknown field types fail loudly."""
    default = field.default
    if isinstance(default, bool):
        return [not default]
    if field.name == "products":
        return ["triton"]
    if field.name == "backward_row_chunk":
        return [0, 2048]
    if field.name == "path":
        return ["lean", "balanced"]
    if field.name == "scratch_mb":
        return [256, 1024]
    raise AssertionError(f"new CCEOptions field {field.name!r} ({field.type}): add its values to this test")


def test_every_option_changes_the_uuid():
    fields = dataclasses.fields(CCEOptions)
    assert {f.name for f in fields} >= {"drop_logits", "exact", "products", "backward_row_chunk"}
    base = CCEOptions()
    variants = {"default": base}
    for field in fields:
        for value in _alternatives(field):
            variants[f"{field.name}={value!r}"] = dataclasses.replace(base, **{field.name: value})
    # every pair of one-field changes as well (no two options may cancel out in the key)
    for a in fields:
        for b in fields:
            if a.name < b.name:
                variants[f"{a.name}+{b.name}"] = dataclasses.replace(
                    base, **{a.name: _alternatives(a)[0], b.name: _alternatives(b)[0]}
                )
    uuids = {name: CCEGraphPass(options).uuid() for name, options in variants.items()}
    assert all(isinstance(u, str) and u for u in uuids.values()), uuids
    by_uuid: dict = {}
    for name, u in uuids.items():
        by_uuid.setdefault(u, []).append(name)
    clashes = [names for names in by_uuid.values() if len(names) > 1]
    assert not clashes, f"options sharing one uuid: {clashes}"
    # and the uuid is a function of the options: equal options, equal uuid
    for name, options in variants.items():
        assert CCEGraphPass(dataclasses.replace(options)).uuid() == uuids[name], name


ENV_OPTIONS = {
    "CCE_INDUCTOR_DROP_LOGITS": "1",
    "CCE_INDUCTOR_EXACT": "1",
    "CCE_INDUCTOR_PRODUCTS": "triton",
    "CCE_INDUCTOR_BACKWARD_ROW_CHUNK": "2048",
    "CCE_INDUCTOR_PATH": "balanced",
    "CCE_INDUCTOR_SCRATCH_MB": "1024",
    "CCE_INDUCTOR_LAZY_LOGITS": "0",
}


@pytest.mark.parametrize("variable", list(ENV_OPTIONS))
def test_every_environment_option_changes_the_uuid(monkeypatch, variable):
    for name in ENV_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    base = CCEGraphPass(CCEOptions.from_env()).uuid()
    monkeypatch.setenv(variable, ENV_OPTIONS[variable])
    assert CCEGraphPass(CCEOptions.from_env()).uuid() != base


def test_environment_covers_every_field(monkeypatch):
    """Each CCEOptions field has an environment variable (so the table above is exhaustive)."""
    for name in ENV_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    base = CCEOptions.from_env()
    changed = set()
    for variable, value in ENV_OPTIONS.items():
        monkeypatch.setenv(variable, value)
        options = CCEOptions.from_env()
        changed |= {f.name for f in dataclasses.fields(CCEOptions) if getattr(options, f.name) != getattr(base, f.name)}
        monkeypatch.delenv(variable)
    assert changed == {f.name for f in dataclasses.fields(CCEOptions)}


# ----------------------------------------------------------------------------------------------------------------
# Bad, retired and encoded options
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variable, value, error",
    [
        ("CCE_INDUCTOR_EXACT", "maybe", "is not a boolean"),
        ("CCE_INDUCTOR_BACKWARD_ROW_CHUNK", "8k", "not an integer"),
        ("CCE_INDUCTOR_BACKWARD_ROW_CHUNK", "8_192", r"not an integer \(decimal digits\)"),  # int() takes these
        ("CCE_INDUCTOR_SCRATCH_MB", "+64", r"not an integer \(decimal digits\)"),
        ("CCE_INDUCTOR_BACKWARD_ROW_CHUNK", "-1", "must be >= 0"),
        ("CCE_INDUCTOR_PRODUCTS", "cutlass", "'cublas' or"),
    ],
)
def test_bad_environment_options_fail_loudly(monkeypatch, variable, value, error):
    monkeypatch.setenv(variable, value)
    with pytest.raises((ValueError, TypeError), match=error):
        CCEOptions.from_env()


@pytest.mark.parametrize(
    "variable, value, error",
    [
        ("CCE_INDUCTOR_PATH", "fast", "CCE_INDUCTOR_PATH='fast': path must be 'auto', 'lean' or 'balanced'"),
        ("CCE_INDUCTOR_SCRATCH_MB", "-5", "CCE_INDUCTOR_SCRATCH_MB='-5': scratch_mb must be >= 0"),
        ("CCE_INDUCTOR_SCRATCH_MB", "abc", "CCE_INDUCTOR_SCRATCH_MB='abc' is not an integer"),
        ("CCE_INDUCTOR_PATHS", "lean", r"unknown cce_inductor environment option\(s\) \['CCE_INDUCTOR_PATHS'\]"),
    ],
)
def test_environment_errors_name_the_variable(monkeypatch, clean_env, variable, value, error):
    """A bad value says which variable holds it, and a misspelt name is an error, not an option left at its default;
    a keyword override does not hide a bad value in the environment."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=error):
        CCEOptions.from_env()
    with pytest.raises(ValueError, match=error):
        cce_inductor.make_backend(path="lean", scratch_mb=0)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(exact=1), "must be a bool"),
        (dict(products="TRITON"), "'cublas' or"),
        (dict(backward_row_chunk=2.0), "int"),
        (dict(backward_row_chunk=True), "int"),
        (dict(scratch_mb=-1), ">= 0"),
        (dict(scratch_mb=0.5), "int"),
        (dict(filter_eps=0.1), "unknown cce_inductor option"),
    ],
)
def test_bad_keyword_options_fail_loudly(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        cce_inductor.make_backend(**kwargs)


@pytest.mark.parametrize("variable", ["CCE_INDUCTOR_FILTER_EPS", "CCE_INDUCTOR_VOCAB_SORT"])
def test_retired_environment_options_say_so(monkeypatch, variable):
    """Gradient filtering was retired: a leftover setting is reported, and the options are the exact defaults."""
    monkeypatch.setenv(variable, "auto")
    with pytest.warns(FutureWarning, match=f"{variable} is ignored"):
        assert CCEOptions.from_env() == CCEOptions()


def test_encoded_options_round_trip():
    for options in (CCEOptions(), CCEOptions(exact=True, products="triton", backward_row_chunk=0, scratch_mb=512)):
        assert CCEOptions.decode(options.encode()) == options
    with pytest.raises(ValueError, match="not an encoded cce_inductor option"):
        CCEOptions.decode("filter_eps=0.1")
