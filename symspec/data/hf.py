"""``hf:DIR``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk``
(``pip install 'symspec[datasets]'``; read with ``datasets.load_from_disk``, nothing is
downloaded).

Splits: the dataset's ``train``, ``validation`` (or ``val``, ``valid``, ``dev``) and
``test`` are ours; ``split=A/B/C`` names the dataset splits that serve as train, val and
test instead. A dataset with a single split (or a plain ``Dataset``) is cut into
contiguous blocks by row, in the proportions of ``split=0.8/0.1/0.1`` (the default).

Columns: ``column=NAME`` picks the text or image column, else the one image column,
else the column named ``text``, else the one text column. A text column is text (its
rows joined by newlines, then tokenised or character-level exactly as ``text:``); an
image column goes with the label column (``label=NAME``, else ``label`` or ``labels``)
and is preprocessed as ``images:``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from symspec.data.base import (
    DataError,
    DataRequest,
    EvalData,
    parse_fractions,
    register_source,
    split_bounds,
)
from symspec.data.images import IMAGE_OPTIONS, image_eval_data, image_prep, to_tensors
from symspec.data.text import TEXT_OPTIONS, sequence_data
from symspec.loading import describe_failure

#: dataset split names that are ours without split=
SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid", "dev"), "test": ("test",)}
LABEL_NAMES = ("label", "labels")
HF_OPTIONS = tuple(dict.fromkeys((*TEXT_OPTIONS, *IMAGE_OPTIONS, "column", "label")))


def _load(root: Path) -> dict[str, Any]:
    """The dataset's splits by name (a plain Dataset is one split, ``train``)."""
    try:
        import datasets  # optional: the datasets extra
    except ImportError as e:
        raise DataError(f"{root}: hf: data needs the datasets library (pip install 'symspec[datasets]')") from e
    if not root.is_dir():
        raise DataError(f"{root}: no such dataset folder (hf:DIR reads a dataset saved with save_to_disk)")
    try:
        loaded = datasets.load_from_disk(str(root))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError... for folders it cannot read
        raise DataError(f"{root}: not a dataset saved with save_to_disk ({describe_failure(e)})") from None
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


def _names_option(req: DataRequest) -> list[str] | None:
    """``split=A/B/C`` as dataset split names (None: absent, or fractions)."""
    text = req.source.options.get("split")
    if text is None:
        return None
    parts = text.split("/")
    try:
        [float(p) for p in parts]
        return None
    except ValueError:
        pass
    if len(parts) != 3 or not all(parts):
        raise DataError(f"--data {req.source}: split={text!r}: expected three dataset split names (train/validation/test) "
                        "or three fractions (0.8/0.1/0.1)")
    return parts


def _rows(req: DataRequest, root: Path, splits: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    """The rows of our split: (dataset, where they come from, details)."""
    there = ", ".join(splits)
    names = _names_option(req)
    if names is not None:
        name = names[("train", "val", "test").index(req.split)]
        if name not in splits:
            raise DataError(f"{root}: unknown split '{name}' in split={req.source.options['split']}; splits there are: {there}")
        return splits[name], f"{root} [{name}]", {"dataset_split": name}
    if len(splits) == 1:
        (name, ds), = splits.items()
        fractions = parse_fractions(req.source)
        start, stop = split_bounds(len(ds), fractions, req.split)
        return ds.select(range(start, stop)), f"{root} [{name}]", {"dataset_split": name, "fractions": list(fractions)}
    if "split" in req.source.options:
        raise DataError(f"--data {req.source}: split fractions apply to a dataset with one split; {root} has "
                        f"{there} (name the ones to use: split=TRAIN/VAL/TEST)")
    name = next((n for n in SPLIT_NAMES[req.split] if n in splits), None)
    if name is None:
        raise DataError(f"{root}: no dataset split for the {req.split} split (splits there are: {there}); "
                        "name the ones to use with hf:DIR,split=TRAIN/VAL/TEST")
    return splits[name], f"{root} [{name}]", {"dataset_split": name}


def _column(req: DataRequest, ds: Any, where: str) -> tuple[str, str]:
    """(column, "text" or "image")."""
    import datasets  # optional: the datasets extra

    features = ds.features
    kinds = {c: "image" if isinstance(f, datasets.Image)
             else "text" if isinstance(f, datasets.Value) and f.dtype in ("string", "large_string") else None
             for c, f in features.items()}
    given = req.source.options.get("column")
    if given is not None:
        if given not in kinds:
            raise DataError(f"{where}: unknown column '{given}'; columns: {', '.join(kinds)}")
        if kinds[given] is None:
            raise DataError(f"{where}: column '{given}' holds {features[given]}, neither text nor images")
        return given, str(kinds[given])
    images = [c for c, k in kinds.items() if k == "image"]
    texts = [c for c, k in kinds.items() if k == "text"]
    if len(images) == 1:
        return images[0], "image"
    if "text" in texts:
        return "text", "text"
    if len(texts) == 1 and not images:
        return texts[0], "text"
    raise DataError(f"{where}: cannot tell which column to use (columns: {', '.join(kinds)}); give column=NAME")


def hf_data(req: DataRequest) -> EvalData:
    """``hf:DIR`` (see the module docstring)."""
    root = Path(req.source.arg or "")
    splits = _load(root)
    ds, where, details = _rows(req, root, splits)
    column, kind = _column(req, ds, where)
    name = f"hf:{root}"
    details = {**details, "column": column}
    if kind == "text":
        if "label" in req.source.options:
            raise DataError(f"--data {req.source}: label= is for image columns; '{column}' is text")
        part = "\n".join(ds[column])
        return sequence_data(req, name, where, part, lambda: "\n".join("\n".join(d[column]) for d in splits.values()),
                             {"characters": len(part), **details})
    return _image_rows(req, ds, where, column, name, details)


def _image_rows(req: DataRequest, ds: Any, where: str, column: str, name: str, details: dict[str, Any]) -> EvalData:
    import datasets  # optional: the datasets extra

    label = req.source.options.get("label") or next((c for c in LABEL_NAMES if c in ds.features), None)
    if label is None or label not in ds.features:
        raise DataError(f"{where}: no label column" + (f" '{label}'" if label else "")
                        + f" for the images in '{column}' (columns: {', '.join(ds.features)}); give label=NAME")
    if len(ds) == 0:
        raise DataError(f"{where}: the {req.split} split holds no rows")
    if req.max_samples is not None:
        ds = ds.select(range(min(len(ds), req.max_samples)))
    feature = ds.features[label]
    values = list(ds[label])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        bad = next(v for v in values if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0))
        raise DataError(f"{where}: label column '{label}' holds {bad!r}; labels must be class indices from 0")
    labels = torch.tensor(values, dtype=torch.long)
    classes = feature.num_classes if isinstance(feature, datasets.ClassLabel) else None
    first = ds[0][column]
    prep = image_prep(req, getattr(first, "mode", "RGB"))
    x = to_tensors(((row[column], f"{where} row {i}") for i, row in enumerate(ds)), prep)
    return image_eval_data(req, name, x, labels, classes, {**details, "label": label, "preprocessing": prep.describe()})


register_source("hf", hf_data, options=HF_OPTIONS, syntax="hf:DIR")
