"""What every data source shares: the error, the parsed ``--data`` string, the loaded
split (:class:`EvalData`), the registry of source kinds, option parsing and the splits.

A source kind is one loader function and one :func:`register_source` call; parsing,
the option checks and :func:`~symspec.data.load.load_data` find it in the registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from symspec.errors import SymspecInputError, suggest
from symspec.io_util import refuse_special_file

SPLITS = ("train", "val", "test")
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
AccuracyFn = Callable[[Any, torch.Tensor], torch.Tensor | float]
Batch = tuple[Any, torch.Tensor]


class DataError(SymspecInputError):
    """A data source that cannot be read, is empty, or does not fit the model (exit 2)."""


@attrs.frozen
class DataSource:
    """A parsed ``--data`` string."""

    kind: str
    arg: str | None = None
    options: Mapping[str, str] = attrs.field(factory=dict)
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.kind

    def paths(self) -> list[str]:
        """The files and folders this source reads: its path and those of its options
        that name files (``alphabet=``, ``tokenizer=``)."""
        named = [self.options[k] for k in PATH_OPTIONS if self.options.get(k)]
        return [self.arg, *named] if self.arg else named


#: options whose value is a file or folder the source reads
PATH_OPTIONS = ("alphabet", "tokenizer")


@attrs.define
class EvalData:
    """One split, materialised as batches, with its loss and (where it applies) accuracy.

    ``batches`` is a list of ``(inputs, targets)``; evaluating a model means running
    ``model(*inputs)`` (or ``model(**inputs)``) on each and weighting the batch loss by
    ``targets.numel()``.

    >>> d = EvalData("t", "hook", "val", [((torch.zeros(2, 3),), torch.zeros(2)), ((torch.ones(1, 3),), torch.ones(1))],
    ...              lambda out, t: out.sum(), None)
    >>> (d.examples, len(d.take(1).batches), [x[0].shape[0] for x in d.inputs()])
    (3, 1, [2, 1])
    """

    name: str
    kind: str
    split: str
    batches: list[Batch]
    loss: LossFn
    accuracy: AccuracyFn | None
    details: dict[str, Any] = attrs.field(factory=dict)

    @property
    def examples(self) -> int:
        return sum(batch_len(t) for _, t in self.batches)

    @property
    def targets(self) -> int:
        return sum(int(t.numel()) for _, t in self.batches)

    def inputs(self) -> Iterator[Any]:
        """The inputs of each batch, in order (what alignment methods run the models on)."""
        return (x for x, _ in self.batches)

    def take(self, n_batches: int | None) -> EvalData:
        """A copy with the first ``n_batches`` batches (all of them for None)."""
        if n_batches is None:
            return attrs.evolve(self, batches=list(self.batches), details=dict(self.details))
        if n_batches < 1:
            raise DataError(f"take: at least 1 batch, got {n_batches}")
        return attrs.evolve(self, batches=self.batches[:n_batches], details=dict(self.details))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> EvalData:
        """A copy with every tensor on ``device`` (floating inputs cast to ``dtype``)."""
        moved = [(move(x, device, dtype), move(t, device, None)) for x, t in self.batches]
        return attrs.evolve(self, batches=moved)

    def describe(self) -> dict[str, Any]:
        return {"source": self.name, "kind": self.kind, "split": self.split, "batches": len(self.batches),
                "examples": self.examples, "targets": self.targets, **self.details}


def batch_len(t: torch.Tensor) -> int:
    return int(t.shape[0]) if t.dim() else 1


def move(x: Any, device: torch.device | str, dtype: torch.dtype | None) -> Any:
    """``x`` (a tensor, or a mapping, tuple or list of them) on ``device``; floating
    tensors cast to ``dtype`` when given."""
    if isinstance(x, torch.Tensor):
        x = x.to(device)
        return x.to(dtype) if dtype is not None and x.is_floating_point() else x
    if isinstance(x, Mapping):
        return {k: move(v, device, dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(move(v, device, dtype) for v in x)
    return x


def slice_inputs(x: Any, n: int) -> Any:
    """The first ``n`` examples of batch inputs ``x`` (tensors, mappings, tuples)."""
    if isinstance(x, torch.Tensor):
        return x[:n]
    if isinstance(x, Mapping):
        return {k: slice_inputs(v, n) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(slice_inputs(v, n) for v in x)
    return x


def make_batches(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> list[Batch]:
    return [((inputs[i : i + batch_size],), targets[i : i + batch_size]) for i in range(0, len(targets), batch_size)]


# --------------------------------------------------------------------------- the registry

@attrs.frozen
class DataRequest:
    """What a loader is asked for: one split of ``source`` for ``model``.

    ``module``: the model file's Python module (its ``data``/``loss``/``accuracy``
    hooks); ``model_dir``: the model's folder (a Hugging Face folder), where a tokenizer
    or ``preprocessor_config.json`` may lie.
    """

    source: DataSource
    split: str
    batch_size: int = 64
    max_samples: int | None = None
    model: torch.nn.Module | None = None
    module: Any = None
    model_dir: Path | None = None
    seed: int = 0


Loader = Callable[[DataRequest], EvalData]


@attrs.frozen
class SourceKind:
    """A registered data source kind.

    ``options``: the ``key=value`` options it takes (None: any, handed to the loader);
    ``path``: whether ``KIND:PATH`` is required (True) or refused (False);
    ``detect``: for a bare path (no ``KIND:`` prefix), whether it is this kind;
    ``syntax``: how its usage is shown in messages (``text:PATH``).
    """

    kind: str
    loader: Loader
    options: tuple[str, ...] | None = ()
    path: bool = True
    detect: Callable[[Path], bool] | None = None
    syntax: str = ""


SOURCES: dict[str, SourceKind] = {}


def register_source(kind: str, loader: Loader, *, options: tuple[str, ...] | None = (), path: bool = True,
                    detect: Callable[[Path], bool] | None = None, syntax: str | None = None) -> SourceKind:
    """Register the data source ``kind`` (``--data KIND:PATH,key=value``): ``loader(request)``
    returns an :class:`EvalData`. Registering a kind again replaces it."""
    entry = SourceKind(kind, loader, tuple(options) if options is not None else None, path, detect,
                       syntax or (f"{kind}:PATH" if path else kind))
    SOURCES[kind] = entry
    return entry


def known_sources() -> str:
    """The registered kinds as they are written, for messages: ``text:PATH, digits, ...``."""
    return ", ".join(s.syntax for s in SOURCES.values())


# --------------------------------------------------------------------------- parsing

def parse_source(text: str) -> DataSource:
    """Parse a ``--data`` string (see :mod:`symspec.data`); raises :class:`DataError`.

    >>> src = parse_source("text:input.txt,context=32")
    >>> (src.kind, src.arg, src.options)
    ('text', 'input.txt', {'context': '32'})
    """
    raw = text.strip()
    if not raw:
        raise DataError(f"empty --data; expected {known_sources()}")
    head, *opts = raw.split(",")
    kind, sep, arg = head.partition(":")
    if not sep or kind not in SOURCES:
        if head in SOURCES:
            kind, arg = head, ""
        else:
            kind, arg = _detect(head), head
    entry = SOURCES[kind]
    options: dict[str, str] = {}
    for o in opts:
        key, eq, value = o.partition("=")
        key = key.strip()
        if not eq or not key:
            raise DataError(f"--data {raw}: option {o!r} is not key=value")
        allowed = entry.options
        if allowed is not None and key not in allowed:
            hint = suggest(key, allowed)
            raise DataError(f"--data {raw}: unknown option '{key}' for {kind} data"
                            + (f"; {hint}" if hint else f"; options: {', '.join(allowed) or 'none'}"))
        options[key] = value.strip()
    if entry.path and not arg:
        raise DataError(f"--data {raw}: {kind} data needs a path ({entry.syntax})")
    if not entry.path and arg:
        raise DataError(f"--data {raw}: {kind} takes no path")
    return DataSource(kind, arg or None, options, raw)


def _detect(head: str) -> str:
    p = Path(head)
    if ":" in head and not p.exists():
        kind = head.partition(":")[0]
        hint = suggest(kind, SOURCES)
        raise DataError(f"--data {head}: unknown data kind '{kind}'" + (f"; {hint}" if hint else f"; known: {known_sources()}"))
    for entry in SOURCES.values():
        if entry.detect is not None and entry.detect(p):
            return entry.kind
    if not p.exists():
        raise DataError(f"--data {head}: no such file or folder, and not a data kind ({known_sources()})")
    raise DataError(f"--data {head}: cannot tell what this file holds; prefix it with its kind ({known_sources()})")


def int_option(src: DataSource, key: str, default: int | None, minimum: int = 1,
               maximum: int | None = None) -> int | None:
    """The integer option ``key`` of ``src`` (``default`` when absent), within bounds."""
    if key not in src.options:
        return default
    try:
        value = int(src.options[key])
    except ValueError:
        raise DataError(f"--data {src}: {key}={src.options[key]!r} is not an integer") from None
    if value < minimum:
        raise DataError(f"--data {src}: {key} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise DataError(f"--data {src}: {key} must be at most {maximum}, got {value}")
    return value


def parse_fractions(src: DataSource) -> tuple[float, float, float]:
    text = src.options.get("split")
    if text is None:
        return DEFAULT_FRACTIONS
    parts = text.split("/")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise DataError(f"--data {src}: split={text!r}: expected three numbers like 0.8/0.1/0.1") from None
    if len(values) != 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise DataError(f"--data {src}: split={text!r}: expected three non-negative numbers like 0.8/0.1/0.1")
    total = sum(values)
    return (values[0] / total, values[1] / total, values[2] / total)


def check_split(split: str) -> None:
    if split not in SPLITS:
        hint = suggest(split, SPLITS)
        raise DataError(f"unknown split '{split}'" + (f"; {hint}" if hint else f"; splits: {', '.join(SPLITS)}"))


def split_bounds(n: int, fractions: tuple[float, float, float], split: str) -> tuple[int, int]:
    """[start, stop) of ``split`` in ``n`` items cut into contiguous blocks.

    >>> [split_bounds(10, (0.8, 0.1, 0.1), s) for s in SPLITS]
    [(0, 8), (8, 9), (9, 10)]
    """
    check_split(split)
    cuts = [0, round(n * fractions[0]), round(n * (fractions[0] + fractions[1])), n]
    i = SPLITS.index(split)
    return cuts[i], cuts[i + 1]


# --------------------------------------------------------------------------- model facts

def model_config(model: torch.nn.Module | None) -> Any:
    return getattr(model, "config", None) if model is not None else None


def config_int(model: torch.nn.Module | None, *names: str) -> int | None:
    """The first of ``names`` that the model's config holds as an integer (or a tuple
    or list of them: its first)."""
    cfg = model_config(model)
    if cfg is None:
        return None
    for n in names:
        value = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], int):
            return value[0]
    return None


def read_text(path: Path, what: str = "text file") -> str:
    if not path.exists():
        raise DataError(f"{path}: no such {what}")
    refuse_special_file(path, what, DataError)  # a folder, a device or a FIFO: said as such
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
