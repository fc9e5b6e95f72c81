"""The one options object, from the user to the kernels.

``CCEOptions`` is built by :func:`cce_inductor.make_backend` / :func:`cce_inductor.enable` (keywords), from the
``CCE_INDUCTOR_*`` environment (:meth:`CCEOptions.from_env`) or by hand for the functional API. The pass puts
it in its cache key (:meth:`CCEOptions.cache_key`) and hands the fields the op reads to every fused call as one
string (:meth:`CCEOptions.encode`, read back by :meth:`CCEOptions.decode`): a schema argument, so a graph
compiled under other options is another graph to Inductor's caches, too.

Block sizes and pipeline depths are not options: they are per-device constants beside the kernel that uses
them (``cce_inductor/kernels``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
from typing import Any, Literal

__all__ = ["CCEOptions"]

_TRUTHY = ("1", "true", "yes", "on")
_FALSY = ("0", "false", "no", "off")

# Options of earlier versions that no longer exist; setting one says so instead of being silently ignored.
_RETIRED_ENV = {
    "CCE_INDUCTOR_FILTER_EPS": "gradient filtering was retired (docs/design.md, 'Gradient filtering: retired'); "
    "gradients are exact",
    "CCE_INDUCTOR_VOCAB_SORT": "vocabulary sorting was retired with gradient filtering",
}

Products = Literal["auto", "cublas", "triton"]
PathName = Literal["auto", "lean", "balanced"]


@dataclasses.dataclass(frozen=True)
class CCEOptions:
    """How rewritten sites compute their loss; every field is validated and part of the pass's cache key.

    lazy_logits: when the logits also leave the compiled region (Hugging Face models return them), rewrite the site
        anyway and return in their place logits computed on first use (``LazyLogits``: the hidden-state rows and the
        head are held, ``N x D``, not ``N x V``; code that reads them gets the graph's numbers, code that does not
        pays nothing more; a backward through them raises). On by default; off, such a site is left to Inductor.
        ``drop_logits`` wins over it. Under CUDA graphs (``mode="reduce-overhead"``) its op runs between the recorded
        graphs (Inductor's ``graph_partition``, on by default); with partitioning off such sites are left alone.
        Environment: ``CCE_INDUCTOR_LAZY_LOGITS=0`` turns it off.
    drop_logits: when the logits also leave the compiled region, return in their place a placeholder of their shape
        and dtype that raises on any use (``DroppedLogits``): for code that must never compute them. Off by default
        (docs/design.md, "Dropping logits by default?"; docs/clients.md, "The one switch: lazy logits").
        Environment: ``CCE_INDUCTOR_DROP_LOGITS=1``.
    exact: gradients at no more than torch.compile's error: the lean path (the softmax gradient rounded once to the
        input dtype, the products summed in fp32, each gradient rounded once); with a forced balanced path, dC summed
        as an exact pair. Environment: ``CCE_INDUCTOR_EXACT=1``.
    products: who computes the CUDA lean backward's dE / dC products, and the balanced path's logits, dE and dC
        products. ``"auto"`` (default) decides per call: where an earlier call of the same head had at least 10%
        of its targets ignored (prompt-masked SFT, padding), cuBLAS multiplies only as many rows as that call
        counted (the compacted batch, counted rows first) and the row-skipping Triton products any counted rows past
        them; else cuBLAS multiplies every row. Read without waiting on the device
        (``cce_inductor/_counted_share.py``), counted in ``stats()['backward_products']`` and
        ``stats()['balanced_rows']``. ``"cublas"``: every row, every call (bits that never depend on earlier
        calls); ``"triton"``: the row-skipping Triton products always. Environment: ``CCE_INDUCTOR_PRODUCTS``.
    backward_row_chunk: rows per block of the CUDA lean backward: bounds its gradient block (one 16-bit
        ``row_chunk x 4096`` block, wider for a short batch of the same bytes) whatever the batch; dE is summed in
        fp32 (``N x D x 4`` bytes) and, past one row chunk, each vocabulary chunk of dC too, so every gradient is
        rounded once. 0 takes all rows in one block. Environment: ``CCE_INDUCTOR_BACKWARD_ROW_CHUNK``.
    path: which path a rewritten loss takes. ``"auto"`` (default): per site, the balanced path (the gradients
        computed with the loss: three matmuls, as torch.compile does; a 16-bit dC summed in its own dtype over at
        most two row chunks, within 1.35x torch.compile's error, or as an exact pair where that fits the memory
        target), else the lean path (four matmuls, fp32 sums; the least memory). ``"lean"`` / ``"balanced"`` force one;
        a forced path that the automatic choice would not take says so in ``stats()``. The balanced path computes
        mean and sum losses whose head needs gradients; per-row outputs, a reused log-sum-exp and the
        vocabulary-parallel loss are always lean. ``cce_inductor/paths.py`` holds the rule and its memory model.
        Environment: ``CCE_INDUCTOR_PATH``.
    scratch_mb: the balanced path's scratch for one row chunk of logits, in MiB; 0 (default) plans it at run time
        (``cce_inductor.paths.balanced_plan``). A value > 0 with ``path="auto"`` asks for the balanced path (its
        meaning before the automatic choice existed). Environment: ``CCE_INDUCTOR_SCRATCH_MB``.
    """

    drop_logits: bool = False
    exact: bool = False
    products: Products = "auto"
    backward_row_chunk: int = 8192
    path: PathName = "auto"
    scratch_mb: int = 0
    lazy_logits: bool = True

    def __post_init__(self) -> None:
        for name in ("drop_logits", "exact", "lazy_logits"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.products not in ("auto", "cublas", "triton"):
            raise ValueError(f"products must be 'auto', 'cublas' or 'triton', got {self.products!r}")
        if isinstance(self.backward_row_chunk, bool) or not isinstance(self.backward_row_chunk, int):
            raise TypeError(f"backward_row_chunk must be an int, got {self.backward_row_chunk!r}")
        if self.backward_row_chunk < 0:
            raise ValueError(f"backward_row_chunk must be >= 0 (0: all rows), got {self.backward_row_chunk}")
        if self.path not in ("auto", "lean", "balanced"):
            raise ValueError(f"path must be 'auto', 'lean' or 'balanced', got {self.path!r}")
        if isinstance(self.scratch_mb, bool) or not isinstance(self.scratch_mb, int):
            raise TypeError(f"scratch_mb must be an int, got {self.scratch_mb!r}")
        if self.scratch_mb < 0:
            raise ValueError(f"scratch_mb must be >= 0 (0: sized automatically), got {self.scratch_mb}")

    @classmethod
    def from_env(cls, **overrides: Any) -> CCEOptions:
        """Options from the ``CCE_INDUCTOR_*`` environment, then ``overrides`` (keywords named like the fields;
        ``None`` leaves a field to the environment). A bad value or an unknown ``CCE_INDUCTOR_*`` name raises a
        ``ValueError`` / ``TypeError`` that names the variable: a typo never leaves an option at its default."""
        for name, why in _RETIRED_ENV.items():
            if os.environ.get(name, "").strip():
                warnings.warn(f"{name} is ignored: {why}", FutureWarning, stacklevel=3)
        _check_names(overrides)
        _check_env_names()
        values: dict[str, Any] = {}
        for name, field in _FIELDS.items():
            raw = os.environ.get(_env_name(name), "").strip()
            if raw:
                values[name] = _from_env_value(name, raw, field)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def cache_key(self) -> str:
        return ",".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS)

    def encode(self) -> str:
        """The fields the op reads, as the one string argument of every fused call (see :meth:`decode`)."""
        return ";".join(f"{name}={getattr(self, name)}" for name in _OP_FIELDS)

    @staticmethod
    def decode(encoded: str) -> CCEOptions:
        """Inverse of :meth:`encode` (fields the op does not read keep their defaults)."""
        return _decode(encoded)


_FIELDS = {field.name: field for field in dataclasses.fields(CCEOptions)}
# drop_logits and lazy_logits change the graph around the op, not what the op computes.
_OP_FIELDS = ("exact", "products", "backward_row_chunk", "path", "scratch_mb")


def _env_name(field: str) -> str:
    return f"CCE_INDUCTOR_{field.upper()}"


def _check_env_names() -> None:
    known = {_env_name(name) for name in _FIELDS} | set(_RETIRED_ENV)
    unknown = sorted(name for name in os.environ if name.startswith("CCE_INDUCTOR_") and name not in known)
    if unknown:
        raise ValueError(
            f"unknown cce_inductor environment option(s) {unknown}; the options are "
            f"{sorted(_env_name(name) for name in _FIELDS)}"
        )


def _from_env_value(name: str, raw: str, field: dataclasses.Field) -> Any:
    """One field's value from its variable, checked as the field checks it; an error names the variable."""
    variable = _env_name(name)
    value = _parse(variable, raw, field.type)
    try:
        CCEOptions(**{name: value})
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{variable}={raw!r}: {exc}") from None
    return value


def _parse(name: str, raw: str, annotation: Any) -> Any:
    kind = str(annotation)
    if kind == "bool":
        if raw.lower() in _TRUTHY:
            return True
        if raw.lower() in _FALSY:
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")
    if kind == "int":  # decimal digits (and a minus, for the range check's message): not 1_000, +64 or 0x40
        if not re.fullmatch(r"-?[0-9]+", raw):
            raise ValueError(f"{name}={raw!r} is not an integer (decimal digits)")
        return int(raw)
    return raw


@functools.cache
def _decode(encoded: str) -> CCEOptions:
    values: dict[str, Any] = {}
    for item in encoded.split(";"):
        name, _, raw = item.partition("=")
        if name not in _OP_FIELDS:
            raise ValueError(f"not an encoded cce_inductor option: {item!r} in {encoded!r}")
        values[name] = _parse(name, raw, _FIELDS[name].type)
    return CCEOptions(**values)


def resolve(options: CCEOptions | None, overrides: dict[str, Any]) -> CCEOptions:
    """``options`` with keyword ``overrides`` applied, or options from the environment and the overrides."""
    if options is None:
        return CCEOptions.from_env(**overrides)
    _check_names(overrides)
    return dataclasses.replace(options, **{k: v for k, v in overrides.items() if v is not None})


def _check_names(overrides: dict[str, Any]) -> None:
    unknown = set(overrides) - set(_FIELDS)
    if unknown:
        raise TypeError(f"unknown cce_inductor option(s) {sorted(unknown)}; the options are {list(_FIELDS)}")
