"""What a captured graph may call, and how a node's JSON is bound to its op.

A captured graph comes from any user on the socket, and torch.fx turns the
graph it is loaded into Python source that it exec's.  So nothing from the
text reaches torch.fx unless this module produced it from a checked value:

- the op is `getitem` or `aten.<packet>.<overload>` with <packet> in ALLOWED
  (docs/protocol.md, "Captured graphs", has the table), an overload that
  mutates nothing and returns tensors only;
- the node's positional arguments and keyword names are bound to that
  overload's schema: at most its positional count, keyword names exactly
  its argument names (not one already given positionally; json's duplicate
  keys are refused by the parser), every argument without a default given;
- each value has its schema argument's type (tensor references where a
  Tensor is expected, ints, floats, bools, lists of them, dtypes, layouts,
  memory formats, the CPU device, None where optional) and a string only
  where the schema takes one and only as one of the values in STRINGS;
- the bound keywords are keyed by the schema's own argument names, and
  strings are STRINGS' own objects: the text's keys and strings are dropped.

Ops whose eager kernels trust index values (max_pool*_with_indices_backward,
max_unpool*, embedding_dense_backward, _embedding_bag*, nll_loss*, ...) are
not in ALLOWED, so the worker's eager runs of a graph (compile.py `dry_run`
on generated inputs, the parity reference) call kernels that check what
they read.  Integer division, remainder and fmod (INT_DIVISION) are refused
by the fake run when their result is integral: a compiled kernel's C++
integer division by zero is SIGFPE.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Union

import torch

from .errors import GraphError

Json = Union[None, bool, int, float, str, list["Json"], dict[str, "Json"]]

# The operator packets a captured graph may call, by what a solver step needs.
ALLOWED: dict[str, tuple[str, ...]] = {
    "pointwise": (
        "abs", "neg", "add", "sub", "mul", "div", "pow", "exp", "exp2", "expm1", "log",
        "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tan",
        "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
        "sigmoid", "erf", "erfc", "erfinv", "sign", "sgn", "floor", "ceil", "round",
        "trunc", "frac", "maximum", "minimum", "fmax", "fmin", "hypot", "copysign", "lerp",
        "relu", "gelu", "silu", "hardtanh", "elu", "leaky_relu", "softplus", "nan_to_num",
        "remainder", "fmod", "floor_divide", "bitwise_and", "bitwise_or", "bitwise_xor",
        "bitwise_not", "logical_and", "logical_or", "logical_xor", "logical_not", "isnan",
        "isinf", "_softmax", "_log_softmax", "mish", "hardsigmoid", "hardswish"),
    "comparison": ("eq", "ne", "lt", "le", "gt", "ge"),
    "where/clamp": ("where", "clamp", "clamp_min", "clamp_max"),
    "reduction": ("sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin",
                  "var", "var_mean", "std", "any", "all", "linalg_vector_norm", "logsumexp"),
    "scan": ("cumsum", "cumprod"),
    "matmul": ("mm", "bmm", "addmm", "baddbmm", "mv", "dot"),
    "view": ("view", "reshape", "permute", "expand", "slice", "select", "squeeze",
             "unsqueeze", "alias", "t", "transpose", "diagonal", "unbind", "split",
             "split_with_sizes"),
    "layout": ("cat", "stack", "flip", "roll", "repeat", "tril", "triu", "constant_pad_nd",
               "slice_scatter", "select_scatter", "diagonal_scatter"),
    "creation": ("full", "zeros", "ones", "arange", "scalar_tensor", "full_like",
                 "zeros_like", "ones_like"),
    "copy": ("_to_copy", "clone", "copy"),
    # eager kernels check their indices (a colleague bounds the compiled ones)
    "indexing": ("gather", "index", "index_select", "scatter", "scatter_add",
                 "scatter_reduce", "index_put", "index_add"),
    # torch.export's decomposed forms of torch.linalg.solve & co.
    "linear algebra": ("_linalg_solve_ex", "linalg_lu_factor_ex", "linalg_lu_solve",
                       "linalg_solve_triangular", "triangular_solve", "linalg_cholesky_ex",
                       "cholesky_solve", "linalg_inv_ex", "_linalg_det"),
}
PACKETS = frozenset(p for group in ALLOWED.values() for p in group)

# integer results of these are a C++ integer division in a compiled kernel
INT_DIVISION = frozenset({"div", "remainder", "fmod", "floor_divide"})

# An argument whose value comes from an op of ours, never the text's: pivots
# index rows in LAPACK's getrs, which does not check them.
PRODUCED_BY = {("linalg_lu_solve", "pivots"): ("linalg_lu_factor_ex", 1)}

# The strings a schema's `str` arguments may hold, by argument name.
STRINGS: dict[str, tuple[str, ...]] = {
    "rounding_mode": ("trunc", "floor"),
    "approximate": ("none", "tanh"),
    "reduce": ("sum", "prod", "mean", "amax", "amin", "add", "multiply"),
}

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
ENUMS: dict[str, dict[str, Any]] = {
    "ScalarType": {f"dtype:{k}": v for k, v in DTYPES.items()},
    "Layout": {"layout:strided": torch.strided},
    "MemoryFormat": {"memory_format:contiguous_format": torch.contiguous_format,
                     "memory_format:preserve_format": torch.preserve_format,
                     "memory_format:channels_last": torch.channels_last},
    "Device": {"device:cpu": torch.device("cpu")},
}
FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
MAX_LIST = 4096
INT64 = 1 << 63

Ref = Callable[[str, Json, str], torch.fx.Node]  # ("n"|"i"|"k", index, path) -> node


def _need(cond: bool, message: str, path: str) -> None:
    if not cond:
        raise GraphError(message, path)


def resolve(name: Json, path: str) -> Callable[..., Any]:
    """The allow-listed overload `name` names, or GraphError naming it."""
    _need(isinstance(name, str) and len(name) <= 160, f"{path}.op must be an op name", path)
    assert isinstance(name, str)
    parts = name.split(".")
    shown = name.encode("unicode_escape").decode("ascii")
    _need(len(parts) == 3 and parts[0] == "aten",
          f"{path}.op {shown!r} is not an ATen operator (aten.<name>.<overload>)", path)
    packet, overload = parts[1], parts[2]
    _need(packet in PACKETS, f"{path}.op {shown} is not allowed in a captured graph (not in "
          "the allow-list of docs/protocol.md, \"Captured graphs\")", path)
    try:
        op = getattr(getattr(torch.ops.aten, packet), overload)
    except (AttributeError, RuntimeError):
        raise GraphError(f"{path}.op {shown}: {packet} has no overload {overload!r} in torch "
                         f"{torch.__version__}", path) from None
    schema = op._schema
    _need(isinstance(op, torch._ops.OpOverload) and not schema.is_mutable
          and bool(schema.returns)
          and all(str(r.real_type) in ("Tensor", "List[Tensor]") for r in schema.returns),
          f"{path}.op {shown} is not allowed in a captured graph (it mutates its arguments "
          "or returns something other than tensors)", path)
    return op


def bind(op: Callable[..., Any], args: Json, kwargs: Json, ref: Ref, path: str
         ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for FX, built from the schema and checked values only."""
    _need(isinstance(args, list) and isinstance(kwargs, dict),
          f"{path} needs op, args (a list) and kwargs (a map)", path)
    assert isinstance(args, list) and isinstance(kwargs, dict)
    schema = op._schema  # type: ignore[attr-defined]
    full = f"{schema.name}.{schema.overload_name}"
    params = list(schema.arguments)
    positional = [a for a in params if not a.kwarg_only]
    _need(len(args) <= len(positional), f"{path}: {full} takes at most "
          f"{len(positional)} positional arguments, not {len(args)}", path)
    names = {a.name: a for a in params}
    given = {a.name for a in positional[:len(args)]}
    for key in kwargs:
        shown = key.encode("unicode_escape").decode("ascii")
        _need(key in names, f"{path}.kwargs: {shown!r} is not an argument of {full}",
              path)
        _need(key not in given, f"{path}.kwargs: {shown!r} is given twice", path)
    out_args = tuple(value(str(a.real_type), a.name, v, ref, f"{path}.args[{i}]")
                     for i, (a, v) in enumerate(zip(positional, args)))
    out_kwargs: dict[str, Any] = {}
    for a in params:  # the schema's own names, in the schema's order
        if a.name in kwargs:
            out_kwargs[a.name] = value(str(a.real_type), a.name, kwargs[a.name], ref,
                                       f"{path}.kwargs.{a.name}")
        elif a.name not in given:
            _need(a.has_default_value(), f"{path}: {full} needs argument {a.name}", path)
    return out_args, out_kwargs


def value(ty: str, arg: str, v: Json, ref: Ref, path: str) -> Any:
    """v as a value of schema type ty (argument arg), or GraphError."""
    if ty.startswith("Optional[") and ty.endswith("]"):
        return None if v is None else value(ty[9:-1], arg, v, ref, path)
    if ty.startswith("List[") and ty.endswith("]"):
        inner = ty[5:-1]
        if inner in ("int", "SymInt") and type(v) is int:
            return value(inner, arg, v, ref, path)
        _need(isinstance(v, list) and len(v) <= MAX_LIST,
              f"{path} must be a list of {inner} (at most {MAX_LIST})", path)
        assert isinstance(v, list)
        return [value(inner, arg, x, ref, f"{path}[{i}]") for i, x in enumerate(v)]
    if ty == "Tensor":
        if not isinstance(v, dict) or list(v) == ["f"]:  # a number torch wraps as a 0-d tensor
            return _number(v, True, path)
        _need(isinstance(v, dict) and len(v) == 1 and next(iter(v)) in ("n", "i", "k"),
              f"{path} must be a tensor reference ({{\"n\"|\"i\"|\"k\": index}})", path)
        assert isinstance(v, dict)
        ((key, index),) = v.items()
        return ref(key, index, path)
    if ty in ("int", "SymInt"):
        _need(type(v) is int and -INT64 <= v < INT64, f"{path} must be an int64", path)
        return int(v)  # type: ignore[arg-type]
    if ty in ("float", "number"):
        return _number(v, ty == "number", path)
    if ty == "bool":
        _need(type(v) is bool, f"{path} must be a boolean", path)
        return bool(v)
    if ty in ENUMS:
        _need(isinstance(v, dict) and len(v) == 1, f"{path} must be a {ty}", path)
        assert isinstance(v, dict)
        ((key, name),) = v.items()
        table = ENUMS[ty]
        tag = f"{key}:{name}" if isinstance(key, str) and isinstance(name, str) else ""
        _need(tag in table, f"{path} must be one of {sorted(table)}", path)
        return table[tag]
    if ty == "str":
        allowed = STRINGS.get(arg, ())
        _need(isinstance(v, str) and v in allowed, f"{path} must be one of {list(allowed)}",
              path)
        return allowed[allowed.index(str(v))]
    raise GraphError(f"{path}: an argument of type {ty} cannot be given in a captured graph",
                     path)


def _number(v: Json, scalar: bool, path: str) -> Any:
    if isinstance(v, dict):
        f = v.get("f") if len(v) == 1 else None
        _need(isinstance(f, str) and f in FLOATS,
              f"{path}: a non-finite float is {{\"f\": \"nan\"|\"inf\"|\"-inf\"}}", path)
        return FLOATS[str(f)]
    if isinstance(v, bool):
        _need(scalar, f"{path} must be a number", path)
        return bool(v)
    if isinstance(v, int):
        _need(-INT64 <= v < INT64, f"{path} must fit an int64", path)
        return int(v)
    _need(isinstance(v, float), f"{path} must be a number", path)
    assert isinstance(v, float)
    _need(math.isfinite(v), f"{path} must be finite (else {{\"f\": ...}})", path)
    return float(v)
