"""Grey digits: ``mnist:DIR_OR_FILE`` (idx files, gzip or plain) and ``digits``
(scikit-learn's bundled 8x8 digits, no download).

Images are normalised with one mean and standard deviation (MNIST's for ``mnist:``,
the data's own for ``digits``), resized with ``size=N`` (area averaging when
shrinking) and repeated over ``channels=C``.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from symspec.data.base import (
    DataError,
    DataRequest,
    DataSource,
    EvalData,
    config_int,
    int_option,
    parse_fractions,
    register_source,
    split_bounds,
)
from symspec.data.images import (
    IMAGE_OPTIONS,
    MAX_CHANNELS,
    MAX_IMAGE_SIZE,
    MNIST_MEAN,
    MNIST_STD,
    image_eval_data,
)


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


def grey_images(req: DataRequest, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float, name: str,
                presplit: bool = False, src: DataSource | None = None) -> EvalData:
    """Grey images [n, rows, cols] (cut into ``req.split`` unless ``presplit``; ``src``:
    the source whose split fractions apply, ``req.source`` by default) normalised,
    resized and repeated over channels as the options say."""
    src = src or req.source
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{name}: {images.shape[0]} images but {labels.shape[0]} labels")
    if not presplit:
        start, stop = split_bounds(images.shape[0], parse_fractions(src), req.split)
        images, labels = images[start:stop], labels[start:stop]
    if images.shape[0] == 0:
        raise DataError(f"{name}: the {req.split} split is empty; change the split fractions (split=0.8/0.1/0.1)")
    if req.max_samples is not None:
        images, labels = images[: req.max_samples], labels[: req.max_samples]
    x = ((images.float() - mean) / std).unsqueeze(1)
    # bounded: every image is resized (and copied per channel) in memory before the
    # model's own size is compared
    size = int_option(src, "size", None, maximum=MAX_IMAGE_SIZE)
    if size is not None and size != x.shape[-1]:
        x = F.interpolate(x, size=(size, size), mode="area" if size < x.shape[-1] else "bilinear")
    channels = int_option(src, "channels", None, maximum=MAX_CHANNELS)
    channels = channels or config_int(req.model, "channels", "num_channels") or 1
    if channels != 1:
        x = x.expand(-1, channels, -1, -1).contiguous()
    return image_eval_data(req, name, x, labels)


def mnist_data(req: DataRequest) -> EvalData:
    """MNIST from idx files. With both train and t10k files, train/val come from the
    training file (in the ratio of their fractions) and test is t10k; with one set,
    it is cut into the three splits."""
    src = req.source
    sets = _mnist_files(src)
    name = f"mnist:{src.arg}"
    mean, std = MNIST_MEAN * 255, MNIST_STD * 255
    if len(sets) == 2:
        (_, ti, tl), (_, si, sl) = sets
        if req.split == "test":
            return grey_images(req, *_read_pair(si, sl), mean, std, name, presplit=True)
        f = parse_fractions(src)
        sub = DataSource(src.kind, src.arg, {**src.options, "split": f"{f[0]}/{f[1]}/0"}, src.text)
        return grey_images(req, *_read_pair(ti, tl), mean, std, name, src=sub)
    _, img, lab = sets[0]
    return grey_images(req, *_read_pair(img, lab), mean, std, name)


def _read_pair(img: Path, lab: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [n, rows, cols] and labels [n] from two idx files (both shapes checked)."""
    images, labels = read_idx(img), read_idx(lab)
    if images.dim() != 3 or labels.dim() != 1:
        raise DataError(f"{img}: expected images [n, rows, cols] and labels [n], got {list(images.shape)} and {list(labels.shape)}")
    return images, labels


def digits_data(req: DataRequest) -> EvalData:
    """scikit-learn's bundled 8x8 digits (1,797 images, values 0-16), no download."""
    try:
        from sklearn.datasets import load_digits  # optional: scikit-learn (the all extra)
    except ImportError as e:
        raise DataError("digits data needs scikit-learn (pip install scikit-learn)") from e
    d = load_digits()
    images = torch.as_tensor(d.images, dtype=torch.float32)
    labels = torch.as_tensor(d.target, dtype=torch.long)
    mean, std = float(images.mean()), float(images.std())
    return grey_images(req, images, labels, mean, std, "digits")


register_source("mnist", mnist_data, options=IMAGE_OPTIONS, syntax="mnist:DIR",
                detect=lambda p: p.is_dir() or "idx" in p.name)
register_source("digits", digits_data, options=IMAGE_OPTIONS, path=False)
