"""Evaluation data and losses for the analyzers: built-in adapters and a model-file hook.

A *data source* is a short string (the CLI's ``--data``)::

    text:PATH[,context=N][,split=0.8/0.1/0.1][,alphabet=PATH]   next-character cross-entropy
    mnist:DIR_OR_FILE[,size=N][,channels=C][,split=...]         MNIST idx files (.gz or not)
    digits[,size=N][,channels=C][,split=...]                    scikit-learn's bundled 8x8 digits
    hook[,key=value...]                                         the model file's own ``data()``

A bare path is recognised too: a ``.txt`` file is ``text:``, a folder or file of idx
files is ``mnist:``. Without ``--data``, a model file that defines ``data`` is used.

Splits are contiguous blocks (train first, then val, then test) in the given
proportions; nothing is shuffled, so a split is the same on every machine.

The model-file hook (names looked up on the model file's module):

- ``data(split, batch_size=..., max_samples=..., seed=..., model=..., **options)``
  returns an iterable of ``(inputs, targets)`` batches; ``inputs`` is what
  ``model.forward`` takes (a tensor, a tuple of positional inputs, a dict of keyword
  inputs). Only the keyword arguments its signature names are passed.
- ``loss(output, targets)`` returns the mean loss of one batch (a scalar tensor); it
  is used with every data source (a model file knows its own output format best).
- ``accuracy(output, targets)`` (optional) returns the fraction correct of one batch.
  Without it, accuracy is ``argmax(output, -1) == targets`` wherever the targets are
  integer class indices shaped like the output without its last axis.

Batch results are weighted by ``targets.numel()`` (tokens for a language model,
examples for a classifier), so the loss of a split does not depend on the batch size.

>>> src = parse_source("text:input.txt,context=32")
>>> (src.kind, src.arg, src.options)
('text', 'input.txt', {'context': '32'})
"""

from __future__ import annotations

import gzip
import inspect
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from symspec.errors import SymspecInputError, suggest

SPLITS = ("train", "val", "test")
KINDS = ("text", "mnist", "digits", "hook")
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)
#: the usual MNIST normalisation (mean and standard deviation of the training pixels)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
#: the largest ``size=`` and ``channels=`` options of image data
MAX_IMAGE_SIZE, MAX_CHANNELS = 1024, 16

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
AccuracyFn = Callable[[Any, torch.Tensor], torch.Tensor | float]


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


@attrs.define
class EvalData:
    """One split, materialised as batches, with its loss and (where it applies) accuracy.

    ``batches`` is a list of ``(inputs, targets)``; evaluating a model means running
    ``model(*inputs)`` (or ``model(**inputs)``) on each and weighting the batch loss by
    ``targets.numel()``.
    """

    name: str
    kind: str
    split: str
    batches: list[tuple[Any, torch.Tensor]]
    loss: LossFn
    accuracy: AccuracyFn | None
    details: dict[str, Any] = attrs.field(factory=dict)

    @property
    def examples(self) -> int:
        return sum(_batch_len(t) for _, t in self.batches)

    @property
    def targets(self) -> int:
        return sum(int(t.numel()) for _, t in self.batches)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> EvalData:
        """A copy with every tensor on ``device`` (floating inputs cast to ``dtype``)."""
        moved = [(_move(x, device, dtype), _move(t, device, None)) for x, t in self.batches]
        return attrs.evolve(self, batches=moved)

    def describe(self) -> dict[str, Any]:
        return {"source": self.name, "kind": self.kind, "split": self.split, "batches": len(self.batches),
                "examples": self.examples, "targets": self.targets, **self.details}


def _batch_len(t: torch.Tensor) -> int:
    return int(t.shape[0]) if t.dim() else 1


def _move(x: Any, device: torch.device | str, dtype: torch.dtype | None) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.to(device)
        return x.to(dtype) if dtype is not None and x.is_floating_point() else x
    if isinstance(x, Mapping):
        return {k: _move(v, device, dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_move(v, device, dtype) for v in x)
    return x


# --------------------------------------------------------------------------- parsing

_OPTIONS: dict[str, tuple[str, ...]] = {
    "text": ("context", "split", "alphabet"),
    "mnist": ("size", "channels", "split"),
    "digits": ("size", "channels", "split"),
    "hook": (),  # any key=value goes to the model file's data()
}


def parse_source(text: str) -> DataSource:
    """Parse a ``--data`` string (see the module docstring); raises :class:`DataError`."""
    raw = text.strip()
    if not raw:
        raise DataError("empty --data; expected text:PATH, mnist:DIR, digits or hook")
    head, *opts = raw.split(",")
    kind, sep, arg = head.partition(":")
    if not sep or kind not in KINDS:
        if head in KINDS:
            kind, arg = head, ""
        else:
            kind, arg = _detect(head), head
    options: dict[str, str] = {}
    for o in opts:
        key, eq, value = o.partition("=")
        key = key.strip()
        if not eq or not key:
            raise DataError(f"--data {raw}: option {o!r} is not key=value")
        allowed = _OPTIONS[kind]
        if kind != "hook" and key not in allowed:
            hint = suggest(key, allowed)
            raise DataError(f"--data {raw}: unknown option '{key}' for {kind} data"
                            + (f"; {hint}" if hint else f"; options: {', '.join(allowed)}"))
        options[key] = value.strip()
    if kind in ("text", "mnist") and not arg:
        raise DataError(f"--data {raw}: {kind} data needs a path ({kind}:PATH)")
    if kind in ("digits", "hook") and arg:
        raise DataError(f"--data {raw}: {kind} takes no path")
    return DataSource(kind, arg or None, options, raw)


def _detect(head: str) -> str:
    p = Path(head)
    known = ", ".join(f"{k}:" for k in ("text", "mnist")) + ", digits, hook"
    if ":" in head and not p.exists():
        kind = head.partition(":")[0]
        hint = suggest(kind, KINDS)
        raise DataError(f"--data {head}: unknown data kind '{kind}'" + (f"; {hint}" if hint else f"; known: {known}"))
    if p.is_dir() or "idx" in p.name:
        return "mnist"
    if p.suffix == ".txt":
        return "text"
    if not p.exists():
        raise DataError(f"--data {head}: no such file or folder, and not a data kind ({known})")
    raise DataError(f"--data {head}: cannot tell what this file holds; prefix it with its kind ({known})")


def _int_option(src: DataSource, key: str, default: int | None, minimum: int = 1,
                maximum: int | None = None) -> int | None:
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


def split_bounds(n: int, fractions: tuple[float, float, float], split: str) -> tuple[int, int]:
    """[start, stop) of ``split`` in ``n`` items cut into contiguous blocks.

    >>> [split_bounds(10, (0.8, 0.1, 0.1), s) for s in SPLITS]
    [(0, 8), (8, 9), (9, 10)]
    """
    if split not in SPLITS:
        hint = suggest(split, SPLITS)
        raise DataError(f"unknown split '{split}'" + (f"; {hint}" if hint else f"; splits: {', '.join(SPLITS)}"))
    cuts = [0, round(n * fractions[0]), round(n * (fractions[0] + fractions[1])), n]
    i = SPLITS.index(split)
    return cuts[i], cuts[i + 1]


# --------------------------------------------------------------------------- model facts

def model_config(model: torch.nn.Module) -> Any:
    return getattr(model, "config", None)


def _config_int(model: torch.nn.Module, *names: str) -> int | None:
    cfg = model_config(model)
    for n in names:
        value = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], int):
            return value[0]
    return None


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, an object with ``.logits`` (Hugging Face),
    a mapping with ``"logits"``, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise DataError(f"cannot find logits in a model output of type {type(output).__name__}; "
                    "define loss(output, targets) in the model file")


def cross_entropy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all targets (tokens or examples)."""
    logits = logits_of(output)
    if logits.dtype in (torch.float16, torch.bfloat16):  # half-precision logits: a float32 loss
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def argmax_accuracy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = logits_of(output)
    return (logits.argmax(-1) == targets).float().mean()


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


# --------------------------------------------------------------------------- adapters

def _batches(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> list[tuple[Any, torch.Tensor]]:
    return [((inputs[i : i + batch_size],), targets[i : i + batch_size]) for i in range(0, len(targets), batch_size)]


def _read_text(path: Path, what: str = "text file") -> str:
    if not path.is_file():
        raise DataError(f"{path}: no such {what}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None


def text_data(src: DataSource, model: torch.nn.Module | None, split: str, batch_size: int,
              max_samples: int | None) -> EvalData:
    """Character-level next-token data: windows of ``context`` characters, targets shifted by one."""
    path = Path(src.arg or "")
    text = _read_text(path)
    if not text:
        raise DataError(f"{path}: the file is empty")
    alphabet_path = src.options.get("alphabet")
    alphabet_text = _read_text(Path(alphabet_path), "alphabet file") if alphabet_path else text
    chars = sorted(set(alphabet_text))
    index = {c: i for i, c in enumerate(chars)}
    missing = sorted(set(text) - set(index))
    if missing:
        raise DataError(f"{path}: {len(missing)} character(s) not in the alphabet of {alphabet_path}: "
                        + ", ".join(repr(c) for c in missing[:8]))
    vocab = len(chars)
    model_vocab = _config_int(model, "vocab_size") if model is not None else None
    if model_vocab is not None and model_vocab != vocab:
        raise DataError(f"{path}: its alphabet has {vocab} characters but the model's vocabulary has {model_vocab}; "
                        "a character model must be evaluated with the alphabet it was trained on "
                        "(use the same text, or text:PATH,alphabet=TRAINING_TEXT)")
    model_ctx = _config_int(model, "block_size", "n_positions", "max_position_embeddings") if model is not None else None
    context = _int_option(src, "context", model_ctx)
    if context is None:
        raise DataError(f"--data {src}: the model's context length is unknown (no config.block_size); give text:PATH,context=N")
    if model_ctx is not None and context > model_ctx:
        raise DataError(f"--data {src}: context {context} is longer than the model's {model_ctx} positions")
    fractions = parse_fractions(src)
    start, stop = split_bounds(len(text), fractions, split)
    ids = torch.tensor([index[c] for c in text[start:stop]], dtype=torch.long)
    windows = (len(ids) - 1) // context if len(ids) > 1 else 0
    if windows == 0:
        raise DataError(f"{path}: the {split} split holds {len(ids)} characters, fewer than one window of "
                        f"{context} + 1; use a larger file, a smaller context or other split fractions")
    if max_samples is not None:
        windows = min(windows, max_samples)
    body = ids[: windows * context + 1]
    x = body[:-1].view(windows, context)
    y = body[1:].view(windows, context)
    return EvalData(f"text:{path}", "text", split, _batches(x, y, batch_size), cross_entropy, argmax_accuracy,
                    {"vocab": vocab, "context": context, "characters": stop - start, "fractions": list(fractions)})


def read_idx(path: Path) -> torch.Tensor:
    """An idx file (the MNIST format; gzip or plain) as a uint8 tensor."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except zlib.error as e:  # a corrupted deflate stream: not an OSError, unlike a bad gzip header or CRC
        raise DataError(f"{path}: a corrupted gzip file ({e})") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot be read ({e})") from None
    if len(raw) < 4:
        raise DataError(f"{path}: too short to be an idx file")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08 or ndim < 1 or ndim > 4:
        raise DataError(f"{path}: not an unsigned-byte idx file (magic {raw[:4].hex()})")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated idx header")
    shape = struct.unpack(">" + "I" * ndim, raw[4:header])
    count = math.prod(shape)
    if len(raw) - header != count:
        raise DataError(f"{path}: holds {len(raw) - header} bytes of data but its header says {list(shape)} ({count})")
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).view(*shape)


def write_idx(path: str | Path, array: torch.Tensor) -> Path:
    """Write a uint8 tensor as an idx file (gzip when the name ends in .gz): the
    inverse of :func:`read_idx`, for tests and small converted data sets."""
    x = torch.as_tensor(array)
    if x.dtype != torch.uint8:
        raise DataError(f"write_idx writes unsigned bytes, got {x.dtype}")
    if not 1 <= x.dim() <= 4:
        raise DataError(f"write_idx writes 1 to 4 dimensions, got {x.dim()}")
    raw = struct.pack(">HBB", 0, 0x08, x.dim()) + struct.pack(">" + "I" * x.dim(), *x.shape)
    raw += x.contiguous().numpy().tobytes()
    p = Path(path)
    p.write_bytes(gzip.compress(raw, mtime=0) if p.suffix == ".gz" else raw)
    return p


def _find_idx(folder: Path, prefix: str, kind: str) -> Path | None:
    found = sorted(folder.glob(f"{prefix}*{kind}*"))
    return found[0] if found else None


def _mnist_files(src: DataSource) -> list[tuple[str, Path, Path]]:
    p = Path(src.arg or "")
    if p.is_file():
        labels = p.with_name(p.name.replace("images-idx3", "labels-idx1"))
        if labels == p or not labels.exists():
            raise DataError(f"{p}: no labels file next to it (expected {labels.name})")
        return [("all", p, labels)]
    if not p.is_dir():
        raise DataError(f"{p}: no such MNIST folder or idx file")
    sets = []
    for prefix in ("train", "t10k"):
        img, lab = _find_idx(p, prefix, "images-idx3"), _find_idx(p, prefix, "labels-idx1")
        if img is not None and lab is not None:
            sets.append((prefix, img, lab))
    if not sets:
        raise DataError(f"{p}: no MNIST idx files (train-images-idx3-ubyte[.gz] or t10k-images-idx3-ubyte[.gz] with labels)")
    return sets


def _images(src: DataSource, images: torch.Tensor, labels: torch.Tensor, model: torch.nn.Module | None, split: str,
            batch_size: int, max_samples: int | None, mean: float, std: float, name: str,
            presplit: bool = False) -> EvalData:
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{name}: {images.shape[0]} images but {labels.shape[0]} labels")
    if not presplit:
        start, stop = split_bounds(images.shape[0], parse_fractions(src), split)
        images, labels = images[start:stop], labels[start:stop]
    if images.shape[0] == 0:
        raise DataError(f"{name}: the {split} split is empty; change the split fractions (split=0.8/0.1/0.1)")
    if max_samples is not None:
        images, labels = images[:max_samples], labels[:max_samples]
    x = ((images.float() - mean) / std).unsqueeze(1)
    # bounded: every image is resized (and copied per channel) in memory before the
    # model's own size is compared
    size = _int_option(src, "size", None, maximum=MAX_IMAGE_SIZE)
    if size is not None and size != x.shape[-1]:
        x = F.interpolate(x, size=(size, size), mode="area" if size < x.shape[-1] else "bilinear")
    channels = _int_option(src, "channels", None, maximum=MAX_CHANNELS)
    model_ch = _config_int(model, "channels", "num_channels") if model is not None else None
    channels = channels or model_ch or 1
    if channels != 1:
        x = x.expand(-1, channels, -1, -1).contiguous()
    if model is not None:
        want = _config_int(model, "image_size")
        if want is not None and want != x.shape[-1]:
            raise DataError(f"{name}: images are {x.shape[-2]}x{x.shape[-1]} but the model takes {want}x{want}; "
                            f"resize them with --data ...,size={want}")
        if model_ch is not None and model_ch != channels:
            raise DataError(f"{name}: images have {channels} channel(s) but the model takes {model_ch}")
        classes = _config_int(model, "n_classes", "num_labels", "num_classes")
        top = int(labels.max()) + 1
        if classes is not None and top > classes:
            raise DataError(f"{name}: labels go up to {top - 1} but the model has {classes} classes")
    y = labels.long()
    details = {"image_size": list(x.shape[-2:]), "channels": channels, "classes": int(labels.max()) + 1}
    return EvalData(name, "images", split, _batches(x, y, batch_size), cross_entropy, argmax_accuracy, details)


def mnist_data(src: DataSource, model: torch.nn.Module | None, split: str, batch_size: int,
               max_samples: int | None) -> EvalData:
    """MNIST from idx files. With both train and t10k files, train/val come from the
    training file (in the ratio of their fractions) and test is t10k; with one set,
    it is cut into the three splits."""
    sets = _mnist_files(src)
    name = f"mnist:{src.arg}"
    if len(sets) == 2:
        (_, ti, tl), (_, si, sl) = sets
        if split == "test":
            return _images(src, *_read_pair(si, sl), model, split, batch_size, max_samples,
                           MNIST_MEAN * 255, MNIST_STD * 255, name, presplit=True)
        f = parse_fractions(src)
        sub = DataSource(src.kind, src.arg, {**src.options, "split": f"{f[0]}/{f[1]}/0"}, src.text)
        return _images(sub, *_read_pair(ti, tl), model, split, batch_size, max_samples,
                       MNIST_MEAN * 255, MNIST_STD * 255, name)
    _, img, lab = sets[0]
    return _images(src, *_read_pair(img, lab), model, split, batch_size, max_samples, MNIST_MEAN * 255, MNIST_STD * 255, name)


def _read_pair(img: Path, lab: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [n, rows, cols] and labels [n] from two idx files (both shapes checked)."""
    images, labels = read_idx(img), read_idx(lab)
    if images.dim() != 3 or labels.dim() != 1:
        raise DataError(f"{img}: expected images [n, rows, cols] and labels [n], got {list(images.shape)} and {list(labels.shape)}")
    return images, labels


def digits_data(src: DataSource, model: torch.nn.Module | None, split: str, batch_size: int,
                max_samples: int | None) -> EvalData:
    """scikit-learn's bundled 8x8 digits (1,797 images, values 0-16), no download."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise DataError("digits data needs scikit-learn (pip install scikit-learn)") from e
    d = load_digits()
    images = torch.as_tensor(d.images, dtype=torch.float32)
    labels = torch.as_tensor(d.target, dtype=torch.long)
    mean, std = float(images.mean()), float(images.std())
    return _images(src, images, labels, model, split, batch_size, max_samples, mean, std, "digits")


def hooks_module(loaded: Any, factory: str | Path | None = None) -> Any:
    """The Python module whose ``data``/``loss``/``accuracy`` hooks apply to ``loaded`` (a
    :class:`~symspec.loading.LoadedModel`): its own model file, else the ``--model`` file
    ``factory``, else None. Beside Hugging Face folders the ``--model`` file only lends
    its hooks: it is imported, its ``build()`` is not called."""
    mf = getattr(loaded, "model_file", None)
    if mf is not None:
        return mf.module
    if factory is None:
        return None
    from symspec.loading import import_file

    return import_file(factory)


def hook_data(src: DataSource, model: torch.nn.Module | None, split: str, batch_size: int,
              max_samples: int | None, module: Any = None, seed: int = 0) -> EvalData:
    """The model file's own ``data(split, ...)``: an iterable of (inputs, targets) batches."""
    fn = getattr(module, "data", None) if module is not None else None
    if not callable(fn):
        if module is None:
            raise DataError("--data hook: no model file to take data(split, ...) from (the models are not model "
                            "files); pass --model model.py that defines data(), or --data text:PATH, mnist:DIR or digits")
        raise DataError(f"--data hook: {getattr(module, '__file__', None) or 'the model file'} defines no "
                        "data(split, ...) function; pass --data text:PATH, mnist:DIR or digits, or add data() to it")
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    offered = {"batch_size": batch_size, "max_samples": max_samples, "seed": seed, "model": model, **src.options}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for k, v in offered.items():
        if k in params or (takes_any and k in src.options):
            kwargs[k] = v
    unused = [k for k in src.options if k not in kwargs]
    if unused:
        raise DataError(f"--data {src}: the model file's data() takes no option '{unused[0]}'")
    try:
        produced = fn(split, **kwargs)
        batches = _collect_batches(produced, max_samples)
    except DataError:
        raise
    except (Exception, SystemExit) as e:  # the model file's own code: sys.exit() there is a failure too
        from symspec.loading import describe_failure, where_in

        origin = getattr(module, "__file__", None)
        where = where_in(e, origin) if origin else "the model file"
        raise DataError(f"{where}: data({split!r}) failed: {describe_failure(e)}") from e
    if not batches:
        raise DataError(f"the model file's data({split!r}) gave no batches: the {split} split is empty")
    return EvalData(f"hook:{getattr(module, '__file__', 'model')}", "hook", split, batches, cross_entropy, None, {})


def _collect_batches(produced: Any, max_samples: int | None) -> list[tuple[Any, torch.Tensor]]:
    if produced is None or isinstance(produced, (torch.Tensor, str, bytes)) or not isinstance(produced, Iterable):
        raise DataError(f"data() must return an iterable of (inputs, targets) batches, got {type(produced).__name__}")
    out: list[tuple[Any, torch.Tensor]] = []
    seen = 0
    for item in produced:
        if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[1], torch.Tensor):
            raise DataError("data() must yield (inputs, targets) pairs with targets a tensor, "
                            f"got {type(item).__name__}" + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))
        x, y = item
        if isinstance(x, list):
            x = tuple(x)
        if max_samples is not None:
            room = max_samples - seen
            if room <= 0:
                break
            if _batch_len(y) > room:
                x, y = _slice(x, room), y[:room]
        seen += _batch_len(y)
        if y.numel():
            out.append((x, y))
    return out


def _slice(x: Any, n: int) -> Any:
    if isinstance(x, torch.Tensor):
        return x[:n]
    if isinstance(x, Mapping):
        return {k: _slice(v, n) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_slice(v, n) for v in x)
    return x


ADAPTERS: dict[str, Callable[..., EvalData]] = {
    "text": text_data,
    "mnist": mnist_data,
    "digits": digits_data,
    "hook": hook_data,
}


def load_data(source: str | DataSource | None, *, model: torch.nn.Module | None = None, module: Any = None,
              split: str = "val", batch_size: int = 64, max_samples: int | None = None,
              loss: LossFn | None = None, accuracy: AccuracyFn | None = None, seed: int = 0) -> EvalData:
    """Load one split of a data source for ``model``, checking that it fits.

    ``module``: the model file's Python module (``LoadedModel.model_file.module``), for
    its ``data``/``loss``/``accuracy`` hooks. ``source=None`` means the hook.
    ``loss``/``accuracy`` override everything; else the model file's ``loss`` and
    ``accuracy`` are used when defined, else the adapter's (cross-entropy, argmax).
    """
    if split not in SPLITS:
        hint = suggest(split, SPLITS)
        raise DataError(f"unknown split '{split}'" + (f"; {hint}" if hint else f"; splits: {', '.join(SPLITS)}"))
    if batch_size < 1:
        raise DataError(f"batch size must be at least 1, got {batch_size}")
    if max_samples is not None and max_samples < 1:
        raise DataError(f"max samples must be at least 1, got {max_samples}")
    if source is None:
        if module is None or not callable(getattr(module, "data", None)):
            raise DataError("no data: pass --data (text:PATH, mnist:DIR, digits) or define data(split, ...) in the model file")
        src = DataSource("hook", None, {}, "hook")
    else:
        src = source if isinstance(source, DataSource) else parse_source(source)
    if src.kind == "hook":
        data = hook_data(src, model, split, batch_size, max_samples, module=module, seed=seed)
    else:
        data = ADAPTERS[src.kind](src, model, split, batch_size, max_samples)
    hook_loss = getattr(module, "loss", None) if module is not None else None
    hook_acc = getattr(module, "accuracy", None) if module is not None else None
    data.loss = loss or (hook_loss if callable(hook_loss) else data.loss)
    if accuracy is not None:
        data.accuracy = accuracy
    elif callable(hook_acc):
        data.accuracy = hook_acc
    elif data.accuracy is None:
        data.accuracy = _default_accuracy_if_classes
    data.details.setdefault("loss", getattr(data.loss, "__name__", type(data.loss).__name__))
    return data


def _default_accuracy_if_classes(output: Any, targets: torch.Tensor) -> torch.Tensor | float:
    """argmax accuracy where targets are class indices; NaN (not reported) elsewhere."""
    try:
        logits = logits_of(output)
    except DataError:
        return math.nan
    if targets.is_floating_point() or logits.shape[:-1] != targets.shape:
        return math.nan
    return (logits.argmax(-1) == targets).float().mean()


def check_fits(model: torch.nn.Module, data: EvalData, label: str = "the model") -> None:
    """Run ``model`` on a few examples of ``data`` and raise :class:`DataError`, naming
    the likely cause (vocabulary, image size, classes), if it cannot take them."""
    inputs, targets = data.batches[0]
    n = min(2, _batch_len(targets))
    x, y = _slice(inputs, n), targets[:n]
    param = next(iter(model.parameters()), None)
    if param is not None:
        x, y = _move(x, param.device, param.dtype), y.to(param.device)
    try:
        with torch.no_grad():
            out = call_model(model, x)
    except (Exception, SystemExit) as e:
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        cause = ""
        if data.kind == "text":
            cause = f" (the data has {data.details.get('vocab')} characters and context {data.details.get('context')}: does the model's vocabulary or context fit?)"
        elif data.kind == "images":
            size = data.details.get("image_size")
            cause = f" (the images are {data.details.get('channels')}x{size[0]}x{size[1]}: does the model take that size? resize with ,size=N)"
        raise DataError(f"{data.name} does not fit {label}: it fails on the first batch with {type(e).__name__}: {msg}{cause}") from e
    if data.kind in ("text", "images"):
        logits = logits_of(out)
        classes = int(data.details.get("vocab") or data.details.get("classes") or 0)
        if logits.shape[:-1] != y.shape:
            raise DataError(f"{data.name} does not fit {label}: outputs of shape {list(logits.shape)} for targets {list(y.shape)}")
        if data.kind == "text" and logits.shape[-1] != classes:
            raise DataError(f"{data.name} does not fit {label}: the model predicts {logits.shape[-1]} classes but the "
                            f"text's alphabet has {classes} characters")
        if logits.shape[-1] < classes:
            raise DataError(f"{data.name} does not fit {label}: the model predicts {logits.shape[-1]} classes but the "
                            f"labels go up to {classes - 1}")
    try:
        value = data.loss(out, y)
    except (Exception, SystemExit) as e:
        raise DataError(f"the loss fails on {data.name} with {label}'s outputs: {type(e).__name__}: {e}") from e
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise DataError(f"loss(output, targets) must return a scalar tensor, got {type(value).__name__}"
                        + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else ""))
