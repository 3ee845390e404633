"""Independently trained models for the benchmarks, cached on disk.

Two tasks, as in the paper's Table 2 but sized for 2 CPU cores:

- ``gpt``: the nanoGPT-style character model (examples/nanogpt.py) on Tiny Shakespeare
  (next-character cross-entropy; splits are contiguous blocks 0.8/0.1/0.1);
- ``vit``: the small ViT (examples/vit.py) on MNIST (the 10,000 test images of
  ../shared/data/mnist split 0.8/0.1/0.1) or, with ``--images digits``,
  scikit-learn's 8x8 digits.

Every model differs only in its seed (initialisation and data order). Checkpoints go to
``bench/cache/<task>-<hash of the recipe>/seed<N>.pt`` with a JSON sidecar (the recipe,
final losses, training time); a cached model is reused when its recipe is unchanged.

Used by bench/lmc_table.py (and bench/bench_universe.py); run on its own to pre-train:
``python -m bench.trained --task gpt --seeds 0 1 2 3 4 5``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from symspec.data import EvalData, load_data
from symspec.loading import import_file

from .fixtures import DEFAULT_MNIST, DEFAULT_TEXT, ROOT

CACHE = ROOT / "bench" / "cache"

#: the training recipes; ``quick`` ones are for the smoke test in the suite
RECIPES: dict[str, dict[str, Any]] = {
    "gpt": {"model": dict(block_size=64, n_layer=2, n_head=4, n_embd=64), "context": 64,
            "batch": 32, "steps": 4000, "lr": 3e-3, "weight_decay": 0.1, "warmup": 100},
    "vit": {"model": dict(image_size=28, patch_size=7, channels=1, n_classes=10, n_layer=2, n_head=4, n_embd=64, mlp_ratio=4),
            "batch": 128, "steps": 1500, "lr": 2e-3, "weight_decay": 0.05, "warmup": 100},
    "gpt-quick": {"model": dict(block_size=32, n_layer=1, n_head=2, n_embd=16, n_ff=32), "context": 32,
                  "batch": 16, "steps": 60, "lr": 1e-2, "weight_decay": 0.0, "warmup": 5},
    "vit-quick": {"model": dict(image_size=8, patch_size=4, channels=1, n_classes=10, n_layer=1, n_head=2, n_embd=16, mlp_ratio=2),
                  "batch": 64, "steps": 60, "lr": 1e-2, "weight_decay": 0.0, "warmup": 5},
}


def example(name: str) -> Any:
    return import_file(ROOT / "examples" / f"{name}.py")


def recipe_key(task: str, data: str, recipe: dict[str, Any]) -> str:
    blob = json.dumps({"task": task, "data": data, "recipe": recipe}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def build(task: str, data: str, recipe: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """A fresh model of the task (vocabulary size read from the text for ``gpt``)."""
    if task.startswith("gpt"):
        mod = example("nanogpt")
        cfg = dict(recipe["model"])
        if "vocab_size" not in cfg:
            cfg["vocab_size"] = len(set(Path(data.partition(":")[2]).read_text(encoding="utf-8")))
        return mod.build(**cfg), mod
    mod = example("vit")
    return mod.build(**recipe["model"]), mod


def data_source(task: str, data: str, recipe: dict[str, Any]) -> str:
    return f"{data},context={recipe['context']}" if task.startswith("gpt") else data


def split(task: str, data: str, recipe: dict[str, Any], model: torch.nn.Module, name: str, batch: int = 256,
          max_samples: int | None = None) -> EvalData:
    return load_data(data_source(task, data, recipe), model=model, split=name, batch_size=batch, max_samples=max_samples)


def _schedule(step: int, recipe: dict[str, Any]) -> float:
    warm, total = recipe["warmup"], recipe["steps"]
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def evaluate(model: torch.nn.Module, data: EvalData) -> tuple[float, float]:
    model.eval()
    total, acc, n = 0.0, 0.0, 0
    with torch.no_grad():
        for x, y in data.batches:
            out = model(*x) if isinstance(x, tuple) else model(x)
            k = int(y.numel())
            total += float(data.loss(out, y)) * k
            if data.accuracy is not None:
                acc += float(data.accuracy(out, y)) * k
            n += k
    return total / n, acc / n


def train(task: str, seed: int, data: str, recipe: dict[str, Any], log: Any = print) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    model, mod = build(task, data, recipe)
    train_data = split(task, data, recipe, model, "train", batch=4096)
    gen = torch.Generator().manual_seed(10_000 + seed)
    if task.startswith("gpt"):
        stream = torch.cat([x[0].reshape(-1) if isinstance(x, tuple) else x.reshape(-1) for x, _ in train_data.batches])
        tail = train_data.batches[-1][1].reshape(-1)[-1:]
        stream = torch.cat([stream, tail])
        ctx = recipe["context"]

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            starts = torch.randint(len(stream) - ctx - 1, (recipe["batch"],), generator=gen)
            idx = starts[:, None] + torch.arange(ctx)
            return stream[idx], stream[idx + 1]
    else:
        xs = torch.cat([x[0] if isinstance(x, tuple) else x for x, _ in train_data.batches])
        ys = torch.cat([y for _, y in train_data.batches])

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.randint(len(xs), (recipe["batch"],), generator=gen)
            return xs[idx], ys[idx]

    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"], betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, recipe))
    start = time.perf_counter()
    model.train()
    for step in range(recipe["steps"]):
        x, y = batch()
        loss = mod.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, recipe["steps"] // 5) == 0:
            log(f"  {task} seed {seed}: step {step}/{recipe['steps']} train loss {loss.item():.3f}")
    seconds = time.perf_counter() - start
    val = split(task, data, recipe, model, "val")
    val_loss, val_acc = evaluate(model, val)
    log(f"  {task} seed {seed}: trained in {seconds:.0f} s, val loss {val_loss:.3f}, val accuracy {val_acc:.3f}")
    return model.eval(), {"seed": seed, "train_seconds": seconds, "val_loss": val_loss, "val_accuracy": val_acc}


def trained_models(task: str, seeds: list[int], data: str, *, cache: Path = CACHE, log: Any = print,
                   recipe: dict[str, Any] | None = None) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Models of ``task`` for each seed, trained now or read from the cache."""
    recipe = recipe or RECIPES[task]
    folder = cache / f"{task}-{recipe_key(task, data, recipe)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.json").write_text(json.dumps({"task": task, "data": data, "recipe": recipe}, indent=2))
    out = []
    for seed in seeds:
        ckpt, meta_path = folder / f"seed{seed}.pt", folder / f"seed{seed}.json"
        if ckpt.exists() and meta_path.exists():
            model, _ = build(task, data, recipe)
            model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
            meta = json.loads(meta_path.read_text())
            meta["cached"] = True
            log(f"  {task} seed {seed}: from cache {ckpt.relative_to(ROOT) if ckpt.is_relative_to(ROOT) else ckpt}")
        else:
            model, meta = train(task, seed, data, recipe, log)
            tmp = ckpt.with_suffix(".tmp")
            torch.save(model.state_dict(), tmp)
            tmp.replace(ckpt)
            meta_path.write_text(json.dumps(meta, indent=2))
            meta["cached"] = False
        meta["checkpoint"] = str(ckpt)
        out.append((model.eval(), meta))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(RECIPES), required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--data", help="text:PATH for gpt, mnist:DIR or digits for vit (default: ../shared/data)")
    args = p.parse_args(argv)
    data = args.data or (f"text:{DEFAULT_TEXT}" if args.task.startswith("gpt") else f"mnist:{DEFAULT_MNIST}")
    torch.set_num_threads(2)
    trained_models(args.task, args.seeds, data)


if __name__ == "__main__":
    main()
