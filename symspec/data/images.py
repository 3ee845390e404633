"""Images for classifiers: what every image source shares, and ``images:DIR`` folders.

``images:DIR`` holds one subfolder per class (class index: the sorted folder names);
with ``train/``, ``val/`` (or ``validation/``) and ``test/`` subfolders, each holding
class folders, those are the splits, else every class's files (sorted by name) are cut
into contiguous train/val/test blocks. The examples of a split take the classes in turn
(the first file of each class, then the second, ...), so ``--max-samples`` keeps them
balanced. Files are decoded with Pillow and preprocessed as the model expects: see
:func:`image_prep`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from symspec.data.base import (
    DataError,
    DataRequest,
    EvalData,
    config_int,
    int_option,
    make_batches,
    parse_fractions,
    register_source,
    split_bounds,
)
from symspec.data.losses import argmax_accuracy, cross_entropy

#: the usual MNIST normalisation (mean and standard deviation of the training pixels)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
#: the largest ``size=`` and ``channels=`` options of image data
MAX_IMAGE_SIZE, MAX_CHANNELS = 1024, 16
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})
#: split folder names and the split each one is
SPLIT_FOLDERS = {"train": "train", "val": "val", "validation": "val", "test": "test"}
IMAGE_OPTIONS = ("size", "channels", "split")
_GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})


def image_eval_data(req: DataRequest, name: str, x: torch.Tensor, labels: torch.Tensor, classes: int | None = None,
                    details: dict[str, Any] | None = None) -> EvalData:
    """Preprocessed images ``x`` [n, C, H, W] and their labels as an :class:`EvalData`,
    after checking them against the model's config (image size, channels, classes)."""
    model = req.model
    channels = int(x.shape[1])
    if model is not None:
        want = config_int(model, "image_size")
        if want is not None and want != x.shape[-1]:
            raise DataError(f"{name}: images are {x.shape[-2]}x{x.shape[-1]} but the model takes {want}x{want}; "
                            f"resize them with --data ...,size={want}")
        model_ch = config_int(model, "channels", "num_channels")
        if model_ch is not None and model_ch != channels:
            raise DataError(f"{name}: images have {channels} channel(s) but the model takes {model_ch}")
        model_classes = config_int(model, "n_classes", "num_labels", "num_classes")
        top = int(labels.max()) + 1
        if model_classes is not None and top > model_classes:
            raise DataError(f"{name}: labels go up to {top - 1} but the model has {model_classes} classes")
    info = {"image_size": list(x.shape[-2:]), "channels": channels,
            "classes": classes if classes is not None else int(labels.max()) + 1, **(details or {})}
    return EvalData(name, "images", req.split, make_batches(x, labels.long(), req.batch_size), cross_entropy,
                    argmax_accuracy, info)


# --------------------------------------------------------------------------- preprocessing

@attrs.frozen
class ImagePrep:
    """How images become model inputs: converted to ``channels`` (1: grey, 3: RGB),
    resized to ``size`` (height, width; None: kept, and then all must agree), scaled by
    ``rescale`` and normalised per channel, ``(x * rescale - mean) / std``."""

    size: tuple[int, int] | None
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255
    origin: str = "defaults"

    def describe(self) -> dict[str, Any]:
        return {"size": list(self.size) if self.size else None, "mean": list(self.mean), "std": list(self.std),
                "rescale": self.rescale, "from": self.origin}


def image_prep(req: DataRequest, first_mode: str) -> ImagePrep:
    """The preprocessing of ``req``'s images. Size: ``size=``, else the model's
    ``config.image_size``, else ``preprocessor_config.json`` in the model folder
    (``crop_size`` after a centre crop, else ``size``), else the images' own. Channels:
    ``channels=``, else ``config.num_channels``/``channels``, else the preprocessor's
    mean, else grey for grey images (``first_mode``: the first image's Pillow mode) and RGB
    otherwise. Mean, std and rescaling: the preprocessor's ``image_mean``, ``image_std``,
    ``rescale_factor`` (with ``do_normalize``/``do_rescale``), else MNIST's."""
    src, pre_path = req.source, (req.model_dir / "preprocessor_config.json" if req.model_dir else None)
    pre = _read_json(pre_path) if pre_path is not None and pre_path.is_file() else {}
    side = int_option(src, "size", None, maximum=MAX_IMAGE_SIZE) or config_int(req.model, "image_size")
    size = (side, side) if side else _preprocessor_size(pre, pre_path)
    mean_raw, std_raw = pre.get("image_mean"), pre.get("image_std")
    channels = (int_option(src, "channels", None, maximum=MAX_CHANNELS) or config_int(req.model, "num_channels", "channels")
                or (len(mean_raw) if isinstance(mean_raw, list) and len(mean_raw) in (1, 3) else None)
                or (1 if first_mode in _GREY_MODES else 3))
    if channels not in (1, 3):
        raise DataError(f"--data {src}: images are read as grey (1 channel) or RGB (3), not {channels} channels")
    if pre and pre.get("do_normalize", True) and mean_raw is not None:
        mean, std = _per_channel(mean_raw, channels, pre_path, "image_mean"), _per_channel(std_raw, channels, pre_path, "image_std")
    elif pre and not pre.get("do_normalize", True):
        mean, std = (0.0,) * channels, (1.0,) * channels
    else:
        mean, std = (MNIST_MEAN,) * channels, (MNIST_STD,) * channels
    rescale = float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) else 1.0
    return ImagePrep(size, channels, mean, std, rescale, str(pre_path) if pre else "defaults")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _preprocessor_size(pre: dict[str, Any], path: Path | None) -> tuple[int, int] | None:
    value = pre.get("crop_size") if pre.get("do_center_crop") and "crop_size" in pre else pre.get("size")
    if value is None:
        return None
    if isinstance(value, int) and value > 0:
        return (value, value)
    if isinstance(value, dict):
        h, w = value.get("height"), value.get("width")
        if isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0:
            return (h, w)
        edge = value.get("shortest_edge")
        if isinstance(edge, int) and edge > 0:
            return (edge, edge)
    raise DataError(f"{path}: size {value!r} is not a size (an integer, or height and width)")


def _per_channel(value: Any, channels: int, path: Path | None, key: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        value = [value]
    if not isinstance(value, list) or len(value) not in (1, channels) or not all(isinstance(v, (int, float)) for v in value):
        raise DataError(f"{path}: {key} {value!r} does not fit {channels} channel(s)")
    if key == "image_std" and any(v <= 0 for v in value):
        raise DataError(f"{path}: {key} {value!r} must be positive")
    return tuple(float(v) for v in value) * (channels if len(value) == 1 else 1)


def open_image(path: Path) -> Any:
    """``path`` decoded by Pillow (a :class:`DataError` naming it when it cannot be)."""
    from PIL import Image  # optional: Pillow (comes with matplotlib)

    try:
        with Image.open(path) as img:
            img.load()
            return img.copy()
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError... on bad files
        raise DataError(f"{path}: not a readable image ({type(e).__name__}: {e})") from None


def to_tensors(images: Iterable[tuple[Any, str]], prep: ImagePrep) -> torch.Tensor:
    """(Pillow image, name) pairs as one preprocessed tensor [n, C, H, W]; the name (a
    file, a dataset row) is what messages about the image say. Decoded one at a time."""
    from PIL import Image  # optional: Pillow (comes with matplotlib)

    mode = "L" if prep.channels == 1 else "RGB"
    ref = (prep.size[1], prep.size[0]) if prep.size else None
    out = []
    for img, name in images:
        if not isinstance(img, Image.Image):
            raise DataError(f"{name}: not an image (a {type(img).__name__})")
        img = img.convert(mode)
        if prep.size is not None and img.size != ref:
            img = img.resize(ref, Image.Resampling.BILINEAR)
        elif ref is None:
            ref = img.size
        elif img.size != ref:
            raise DataError(f"{name}: the image is {img.size[0]}x{img.size[1]} (width x height) but the first one is "
                            f"{ref[0]}x{ref[1]}; resize them all with --data ...,size=N")
        a = torch.from_numpy(np.asarray(img, dtype=np.float32).copy())
        out.append(a.unsqueeze(0) if a.dim() == 2 else a.permute(2, 0, 1))
    x = torch.stack(out) * prep.rescale
    mean = torch.tensor(prep.mean).view(1, -1, 1, 1)
    std = torch.tensor(prep.std).view(1, -1, 1, 1)
    return (x - mean) / std


# --------------------------------------------------------------------------- image folders

def _listed(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def _class_names(folders: Sequence[Path]) -> list[str]:
    return sorted({p.name for f in folders for p in _listed(f) if p.is_dir()})


def _class_files(folder: Path, classes: list[str]) -> list[list[Path]]:
    return [[p for p in _listed(folder / c) if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
            if (folder / c).is_dir() else [] for c in classes]


def _interleave(per_class: list[list[Path]]) -> list[tuple[Path, int]]:
    """(file, class) taking the classes in turn."""
    longest = max((len(f) for f in per_class), default=0)
    return [(files[i], c) for i in range(longest) for c, files in enumerate(per_class) if i < len(files)]


def folder_files(req: DataRequest) -> tuple[list[tuple[Path, int]], list[str]]:
    """The (file, class index) of the requested split of ``images:DIR``, and the class names."""
    root, src = Path(req.source.arg or ""), req.source
    if not root.is_dir():
        raise DataError(f"{root}: no such image folder")
    splits = {SPLIT_FOLDERS[p.name]: p for p in _listed(root) if p.is_dir() and p.name in SPLIT_FOLDERS}
    if splits:
        if "split" in src.options:
            raise DataError(f"--data {src}: split= fractions do not apply to {root}, which has split folders "
                            f"({', '.join(sorted(p.name for p in splits.values()))})")
        if req.split not in splits:
            raise DataError(f"{root}: no folder for the {req.split} split; splits there are: "
                            + ", ".join(p.name for p in splits.values()))
        classes = _class_names(list(splits.values()))
        per_class = _class_files(splits[req.split], classes)
    else:
        classes = _class_names([root])
        fractions = parse_fractions(src)
        per_class = []
        for files in _class_files(root, classes):
            start, stop = split_bounds(len(files), fractions, req.split)
            per_class.append(files[start:stop])
    if not classes:
        raise DataError(f"{root}: no class folders (expected one subfolder of images per class)")
    files = _interleave(per_class)
    if not files:
        raise DataError(f"{root}: the {req.split} split holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files, classes


def folder_data(req: DataRequest) -> EvalData:
    """``images:DIR``: one class per subfolder (see the module docstring)."""
    files, classes = folder_files(req)
    if req.max_samples is not None:
        files = files[: req.max_samples]
    prep = image_prep(req, open_image(files[0][0]).mode)
    x = to_tensors(((open_image(p), str(p)) for p, _ in files), prep)
    labels = torch.tensor([c for _, c in files], dtype=torch.long)
    return image_eval_data(req, f"images:{req.source.arg}", x, labels, len(classes), {"preprocessing": prep.describe()})


register_source("images", folder_data, options=IMAGE_OPTIONS, syntax="images:DIR")
