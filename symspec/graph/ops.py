"""What the graph readers know of each op, in one table keyed by the op's name (its ATen
name without overload in an exported graph, or a function, method or module class name in
a symbolically traced one). Activation sites (:mod:`.sites`) and spec inference
(:mod:`symspec.inference.walk`) both read it.

Each op has a set of properties:

- ``transparent``: keeps every axis and is linear (or a copy);
- ``reshape`` / ``permute``: regroups or reorders axes;
- ``nonlinear``: an elementwise function that is not linear (permutations commute with it);
- ``homogeneous``: positively homogeneous, f(a x) = a f(x) for a > 0 (positive scalings pass it);
- ``activation``: an activation function (a sign flip passes it only where it is ``odd``);
- ``odd``: f(-x) = -f(x);
- ``reduce``: a reduction over an axis;
- ``no_tensor``: makes no feature tensor (sizes, constants, assertions);
- ``site_elementwise``: maps features elementwise, so an activation site may follow it
  (``post:W:k``).

>>> "odd" in OPS["tanh"], "homogeneous" in OPS["relu"]
(True, True)
>>> sorted(ops_with("permute"))[:3]
['mT', 'movedim', 'numpy_T']
"""

from __future__ import annotations

#: op name -> its properties (see the module)
OPS: dict[str, frozenset[str]] = {op: frozenset(props) for op, props in {
    "abs": {"nonlinear", "activation"},
    "bitwise_not": {"nonlinear"},
    "ceil": {"nonlinear"},
    "celu": {"nonlinear", "activation"},
    "clamp": {"nonlinear"},
    "clamp_max": {"nonlinear"},
    "clamp_min": {"nonlinear"},
    "cos": {"nonlinear"},
    "elu": {"nonlinear", "activation"},
    "eq": {"nonlinear"},
    "erf": {"nonlinear", "activation", "odd"},
    "exp": {"nonlinear", "activation"},
    "floor": {"nonlinear"},
    "ge": {"nonlinear"},
    "gelu": {"nonlinear", "activation", "site_elementwise"},
    "gelu_": {"nonlinear"},
    "gt": {"nonlinear"},
    "hardsigmoid": {"nonlinear", "activation"},
    "hardswish": {"nonlinear", "activation"},
    "hardtanh": {"nonlinear", "odd"},
    "isinf": {"nonlinear"},
    "isnan": {"nonlinear"},
    "le": {"nonlinear"},
    "log": {"nonlinear"},
    "log_softmax": {"nonlinear"},
    "logical_not": {"nonlinear"},
    "logit": {"nonlinear"},
    "lt": {"nonlinear"},
    "mish": {"nonlinear", "activation"},
    "ne": {"nonlinear"},
    "pow": {"nonlinear"},
    "reciprocal": {"nonlinear"},
    "relu6": {"nonlinear", "activation"},
    "round": {"nonlinear"},
    "rsqrt": {"nonlinear"},
    "selu": {"nonlinear", "activation"},
    "sigmoid": {"nonlinear", "activation", "site_elementwise"},
    "sign": {"nonlinear", "odd"},
    "silu": {"nonlinear", "activation", "site_elementwise"},
    "silu_": {"nonlinear"},
    "sin": {"nonlinear", "odd"},
    "softplus": {"nonlinear", "activation"},
    "sqrt": {"nonlinear"},
    "square": {"nonlinear", "activation"},
    "tanh": {"nonlinear", "activation", "odd", "site_elementwise"},
    "where": {"nonlinear"},
    "leaky_relu": {"homogeneous", "activation"},
    "prelu": {"homogeneous", "activation"},
    "relu": {"homogeneous", "activation", "site_elementwise"},
    "relu_": {"homogeneous"},
    "threshold": {"homogeneous", "activation"},
    "_softmax": {"activation"},
    "softmax": {"activation"},
    "asinh": {"odd"},
    "atan": {"odd"},
    "sinh": {"odd"},
    "_assert_tensor_metadata": {"transparent", "no_tensor"},
    "_to_copy": {"transparent"},
    "alias": {"transparent", "site_elementwise"},
    "alpha_dropout": {"transparent"},
    "clone": {"transparent", "site_elementwise"},
    "contiguous": {"transparent"},
    "copy": {"transparent"},
    "detach": {"transparent"},
    "dropout": {"transparent", "site_elementwise"},
    "feature_dropout": {"transparent"},
    "identity": {"transparent"},
    "lift_fresh_copy": {"transparent"},
    "native_dropout": {"transparent"},
    "neg": {"transparent"},
    "positive": {"transparent"},
    "to": {"transparent"},
    "type_as": {"transparent"},
    "view_as": {"transparent"},
    "_unsafe_view": {"reshape"},
    "broadcast_to": {"reshape"},
    "expand": {"reshape"},
    "expand_as": {"reshape"},
    "flatten": {"reshape"},
    "reshape": {"reshape"},
    "reshape_as": {"reshape"},
    "squeeze": {"reshape"},
    "unflatten": {"reshape"},
    "unsqueeze": {"reshape"},
    "view": {"reshape"},
    "view_copy": {"reshape"},
    "movedim": {"permute"},
    "mT": {"permute"},
    "numpy_T": {"permute"},
    "permute": {"permute"},
    "swapaxes": {"permute"},
    "t": {"permute"},
    "transpose": {"permute"},
    "_assert_scalar": {"no_tensor"},
    "_local_scalar_dense": {"no_tensor"},
    "arange": {"no_tensor"},
    "empty": {"no_tensor"},
    "empty_like": {"no_tensor"},
    "full": {"no_tensor"},
    "full_like": {"no_tensor"},
    "item": {"no_tensor"},
    "new_empty": {"no_tensor"},
    "new_full": {"no_tensor"},
    "new_ones": {"no_tensor"},
    "new_zeros": {"no_tensor"},
    "ones": {"no_tensor"},
    "ones_like": {"no_tensor"},
    "scalar_tensor": {"no_tensor"},
    "sym_constrain_range_for_size": {"no_tensor"},
    "sym_numel": {"no_tensor"},
    "sym_size": {"no_tensor"},
    "zeros": {"no_tensor"},
    "zeros_like": {"no_tensor"},
    "all": {"reduce"},
    "amax": {"reduce"},
    "amin": {"reduce"},
    "any": {"reduce"},
    "argmax": {"reduce"},
    "argmin": {"reduce"},
    "linalg_vector_norm": {"reduce"},
    "logsumexp": {"reduce"},
    "max": {"reduce"},
    "mean": {"reduce"},
    "min": {"reduce"},
    "norm": {"reduce"},
    "prod": {"reduce"},
    "std": {"reduce"},
    "std_mean": {"reduce"},
    "sum": {"reduce"},
    "var": {"reduce"},
    "var_mean": {"reduce"},
    "Dropout": {"site_elementwise"},
    "GELU": {"site_elementwise"},
    "Identity": {"site_elementwise"},
    "ReLU": {"site_elementwise"},
    "SiLU": {"site_elementwise"},
    "Tanh": {"site_elementwise"},

}.items()}


def ops_with(prop: str) -> frozenset[str]:
    """The ops that have property ``prop``."""
    return frozenset(op for op, props in OPS.items() if prop in props)


#: linear-like ops -> (the weight's position among the arguments, the weight axis that
#: becomes the output's last axis); ``call_module`` layers read their own weight (position None)
LAYER_OUT = {
    "Linear": (None, 0), "Embedding": (None, 1),
    "linear": (1, 0), "addmm": (2, 1), "mm": (1, 1), "matmul": (1, 1), "embedding": (0, 1),
}
#: convolutions -> (the weight's position, the weight axis of its output channels): the
#: channels are the output's axis 1 (``(batch, channels, *positions)``), not its last
CONV_OUT = {"Conv1d": (None, 0), "Conv2d": (None, 0), "conv1d": (1, 0), "conv2d": (1, 0), "convolution": (1, 0)}
#: the position of the embedding table: aten.embedding(weight, ids) in exported graphs,
#: F.embedding(ids, weight) in symbolically traced ones
EMBEDDING_WEIGHT = {"export": 0, "symbolic_trace": 1}
#: linear-like ops -> (the weight's position, the weight axis that reads the input's
#: last axis, the input's position)
LAYER_IN = {"Linear": (None, 1, 0), "linear": (1, 1, 0), "addmm": (2, 0, 1), "mm": (1, 0, 0)}
