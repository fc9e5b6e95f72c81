"""What a compiled model returns in place of logits it no longer computes (the ``drop_logits`` option).

With ``drop_logits`` the pass rewrites a loss whose logits are also returned from the graph (Hugging Face models
return them) and puts ``torch.ops.cce_inductor.dropped_logits`` in their place. The op's fake impl is a plain
tensor of the logits' shape, dtype and device with zero strides (Inductor allocates nothing for it and its
``assert_size_stride`` holds); its real impl returns a :class:`DroppedLogits`: one NaN element of storage, expanded
to the logits' shape, whose every use raises an error naming the option and how to turn it off. Reading its
shape, dtype, device, ``requires_grad`` or ``repr`` still works, so code that only inspects the output keeps
working, and code that computes with it (an entropy bonus, token accuracy) fails loudly instead of reading an
empty tensor.

The placeholder never requires grad (the op's only tensor input never requires grad), so AOTAutograd does not
materialise a logits-sized zero gradient for it. The op needs no host synchronisation (one fill kernel for the
one element). Code paths that bypass ``__torch_function__`` (C++ code reading the tensor directly) see NaNs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import Tensor

__all__ = ["DroppedLogits", "dropped_logits_error"]

_T = torch.Tensor

# The placeholder ops (this one and ``_lazy_logits``'s) must run as Python, not be replayed from a CUDA graph: their
# value is the Python object they return. With this tag, Inductor's graph partition (on by default in torch 2.11-2.15)
# records the CUDA graphs of ``mode="reduce-overhead"`` around them and runs them between the replays.
CUDAGRAPH_UNSAFE: tuple = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()

# What may still be done with a placeholder (this one and ``_lazy_logits``'s): metadata only (plus detach and storage
# access, which read no values: autograd bookkeeping and CUDA-graph trees use them).
_PROPERTIES = (
    "shape",
    "dtype",
    "device",
    "layout",
    "ndim",
    "is_leaf",
    "grad_fn",
    "grad",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_sparse",
    "is_nested",
    "is_quantized",
    "is_mkldnn",
    "names",
    "_base",
    "_version",
    "output_nr",
    "itemsize",
    "nbytes",
)
_METHODS = (
    "size",
    "dim",
    "ndimension",
    "numel",
    "nelement",
    "element_size",
    "stride",
    "storage_offset",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "get_device",
    "__len__",
    "data_ptr",
    "untyped_storage",
    "_typed_storage",
    "__hash__",
)
METADATA_READS = {getattr(_T, name).__get__ for name in _PROPERTIES if hasattr(_T, name)} | {
    getattr(_T, name) for name in _METHODS if hasattr(_T, name)
}
_METADATA = METADATA_READS | {_T.requires_grad.__get__}  # (lazy logits answer requires_grad themselves)


def dropped_logits_error(shape: Sequence[int], dtype: torch.dtype, what: str) -> RuntimeError:
    return RuntimeError(
        f"cce_inductor dropped these logits (shape {tuple(shape)}, {dtype}) and returned a placeholder in their "
        f"place, because the drop_logits option is on (CCE_INDUCTOR_DROP_LOGITS=1, make_backend(drop_logits=True) "
        f"or enable(drop_logits=True)): the loss was computed without materialising them. Using the placeholder "
        f"({what}) is an error; only its shape, dtype and device can be read. To get the real logits back, turn "
        f"the option off: unset CCE_INDUCTOR_DROP_LOGITS (or set it to 0), or pass drop_logits=False to "
        f"cce_inductor.make_backend / cce_inductor.enable."
    )


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", "")
    if name == "__get__" and qualname:
        return qualname.rsplit(".", 1)[0]
    return name


class DroppedLogits(torch.Tensor):
    """The placeholder for dropped logits: metadata works, any computation raises (see the module docstring)."""

    @staticmethod
    def wrap(base: Tensor) -> DroppedLogits:
        return Tensor._make_subclass(DroppedLogits, base, False)

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is _T.detach and len(args) == 1 and not kwargs:
            with torch._C.DisableTorchFunctionSubclass():
                return DroppedLogits.wrap(func(args[0]))
        if func is _T.__format__ and len(args) == 2 and args[1] == "":
            return repr(args[0])
        if func is _T.__repr__ and len(args) == 1:
            return repr(args[0])
        placeholder = next(a for a in _flat(args, kwargs) if isinstance(a, DroppedLogits))
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(placeholder.shape), placeholder.dtype
        raise dropped_logits_error(shape, dtype, _name(func))

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return f"DroppedLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise dropped_logits_error(self.shape, self.dtype, "pickling")

    def __deepcopy__(self, memo: Any) -> Any:
        raise dropped_logits_error(self.shape, self.dtype, "deepcopy")


def _flat(args: tuple, kwargs: dict):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


@torch.library.custom_op("cce_inductor::dropped_logits", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def dropped_logits_op(like: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    """A :class:`DroppedLogits` of ``shape`` / ``dtype`` on ``like``'s device (``like``: a tensor that never requires
    grad, see :func:`emit`). One NaN element of storage, zero strides."""
    base = torch.full((1,), math.nan, dtype=dtype, device=like.device).expand(shape)
    return DroppedLogits.wrap(base)


@dropped_logits_op.register_fake
def _(like, shape, dtype):
    return like.new_empty_strided(shape, [0] * len(shape), dtype=dtype)


# --------------------------------------------------------------------------------------------------------------
# The placeholder's shape in the graph
# --------------------------------------------------------------------------------------------------------------
#
# The logits' nodes go away, so a symbolic size of theirs (torch.compile(dynamic=True), or a recompilation that
# marked a dimension dynamic) must be rebuilt from nodes that stay: the hidden states, the targets, the weight.
# A recipe entry is an int, ("size", node, dim) or ("prod", [(node, dim), ...]).

Recipe = list[int | tuple]


def _meta(node: Any) -> Any:
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return None


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def shape_sources(site: Any) -> list[fx.Node | None]:
    """Nodes of a ``linear_cross_entropy.Site`` that outlive the rewrite: their sizes spell the logits' shape."""
    return [site.hidden, site.targets, site.weight]


def shape_recipe(node: fx.Node, sources: Sequence[fx.Node | None]) -> Recipe | str:
    """How to rebuild ``node``'s shape from the sizes of ``sources``: a recipe, or the reason it cannot be."""
    meta = _meta(node)
    if not isinstance(meta, torch.Tensor):
        return f"{node.name} has no tensor metadata"
    if not meta.dtype.is_floating_point:
        return f"{node.name} is {meta.dtype}, not floating-point"
    dims: list[tuple[Any, fx.Node, int]] = []
    for source in sources:
        source_meta = _meta(source)
        if isinstance(source_meta, torch.Tensor) and not isinstance(source_meta, DroppedLogits):
            dims.extend((_expr(size), source, i) for i, size in enumerate(source_meta.shape))
    recipe: Recipe = []
    for size in meta.shape:
        if not isinstance(size, torch.SymInt):
            recipe.append(int(size))
            continue
        if size.node.expr.is_number:
            recipe.append(int(size.node.expr))
            continue
        found = next(((src, i) for expr, src, i in dims if expr == size.node.expr), None)
        if found is not None:
            recipe.append(("size", *found))
            continue
        product = _product_of_leading_dims(size.node.expr, sources)
        if product is None:
            return f"{node.name}'s size {size} is not a size of the hidden states or targets"
        recipe.append(("prod", product))
    return recipe


def _product_of_leading_dims(expr: Any, sources: Sequence[fx.Node | None]) -> list[tuple[fx.Node, int]] | None:
    """``expr`` as the product of all but the last dimension of a source (flattened rows), or None."""
    for source in sources:
        source_meta = _meta(source)
        if not isinstance(source_meta, torch.Tensor) or source_meta.dim() < 2:
            continue
        for end in (source_meta.dim() - 1, source_meta.dim()):
            if sympy.Mul(*[_expr(s) for s in source_meta.shape[:end]]) == expr:
                return [(source, i) for i in range(end)]
    return None


def build_shape(graph: fx.Graph, recipe: Recipe) -> list[Any]:
    """The shape list for ``dropped_logits``, emitting ``size`` nodes at the graph's insertion point."""
    shape: list[Any] = []
    for entry in recipe:
        if isinstance(entry, int):
            shape.append(entry)
        elif entry[0] == "size":
            shape.append(graph.call_method("size", (entry[1], entry[2])))
        else:
            sizes = [graph.call_method("size", (src, i)) for src, i in entry[1]]
            total = sizes[0]
            for size in sizes[1:]:
                total = graph.call_function(operator.mul, (total, size))
            shape.append(total)
    return shape


def emit(graph: fx.Graph, node: fx.Node, site: Any, recipe: Recipe) -> fx.Node:
    """A ``dropped_logits`` node standing for ``node`` (at the graph's insertion point). Its tensor argument only
    gives the device and must not require grad: the site's integer targets, or (a site without targets, e.g. an
    entropy alone) its hidden states detached."""
    like = site.targets if site.targets is not None else graph.call_method("detach", (site.hidden,))
    return graph.call_function(
        torch.ops.cce_inductor.dropped_logits.default, (like, build_shape(graph, recipe), _meta(node).dtype)
    )
