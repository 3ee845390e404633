"""The weight-matching engine: terms and the solver registry (:mod:`.base`), statistics
providers (:mod:`.statistics`, :mod:`.weight_statistics`, :mod:`.activation_statistics`),
how elements act on parameters (:mod:`.acting`), rounding levels (:mod:`.rounding`),
coordinate descent (:mod:`.descent`), how solves run (:mod:`.execution`),
:func:`~.weight.match_weights` (:mod:`.weight`) and restricted groups (:mod:`.restrict`).
The per-kind solvers it looks up are :mod:`symspec.solvers.kinds`.
"""
