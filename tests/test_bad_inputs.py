"""The model, data and command-line side of the bad-input corpus (issue #12): inputs that
a new user or a fault-injection run produced and that once printed a Python traceback
(exit 1), exited 0 without a word, or wrote a useless model. Each row builds its bad
input in tmp_path and runs the command in a clean working folder; it must exit 2 with
one ``error: ...`` line that names the culprit (the file or the option), print no
traceback and write nothing. Each row also runs as its own positive control: the same
command on a good input (the same file done right, a valid value of the option) exits
0, so a row cannot pass because the command fails for another reason.

The spec side is tests/test_bad_spec_inputs.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch

from symspec.data import write_idx
from symspec.loading import load_model
from symspec.runtime import RAY_CONNECT_TIMEOUT, check_ray_address, ray_endpoint
from tests.cli_files import ROOT, model_file, run, write_words
from tests.needs import optional

#: a one-layer ViT on 8x8 images (examples/vit.py), for image data
VIT_MODEL = '''
import torch
from symspec.loading import import_file

_vit = import_file({path!r})


def build():
    torch.manual_seed(0)
    return _vit.build(image_size=8, patch_size=4, n_layer=1, n_head=2, n_embd=8, mlp_ratio=2)


example_inputs = _vit.example_inputs
'''


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Good inputs the rows share (never written to by a row): a word text, a nanoGPT
    model file and a checkpoint of it, a ViT model file, a tiny GPT-2 folder."""
    d = tmp_path_factory.mktemp("bad_inputs_base")
    text = d / "words.txt"
    vocab = write_words(text)
    good = model_file(d, "good.py", vocab)
    torch.save(load_model(good).model.state_dict(), d / "good.pt")
    vit = d / "vit.py"
    vit.write_text(VIT_MODEL.format(path=str(ROOT / "examples" / "vit.py")))
    files = {"dir": d, "text": text, "good": good, "ckpt": d / "good.pt", "vit": vit, "vocab": Path(str(vocab))}
    return files


def hf_folder(base: dict[str, Path]) -> Path:
    """A tiny GPT-2 saved with save_pretrained (built on first use, beside the shared
    folder: only the rows that need transformers build it)."""
    folder = base["dir"].with_name(base["dir"].name + "-gpt2")
    if not folder.exists():
        optional("transformers")
        from tests.zoo import ZOO

        model, _ = ZOO["gpt2"]()
        model.save_pretrained(folder)
    return folder


# -- the rows ---------------------------------------------------------------------------------

Files = dict[str, Path]
#: (folder for this row's files, the shared good inputs, bad?) -> the command's arguments
Build = Callable[[Path, Files, bool], list[str]]


@attrs.frozen
class Case:
    id: str
    build: Build
    #: the part of the error line that names the culprit
    culprit: str
    #: what else the error line must say
    says: str = ""
    #: the command must fail within this many seconds
    seconds: float | None = None


def extra_file(name: str, bad: str, good: str = "") -> Callable[[Path, Files, bool], Path]:
    """A nanoGPT model file ``name`` with ``bad`` (or ``good``) appended."""
    def make(work: Path, base: Files, is_bad: bool) -> Path:
        return model_file(work, name, int(str(base["vocab"])), extra=bad if is_bad else good)

    return make


def check_file(name: str, bad: str, good: str = "") -> Build:
    make = extra_file(name, bad, good)
    return lambda work, base, is_bad: ["check", str(make(work, base, is_bad)), "--samples", "1", "--dtype", "float64"]


def option(command: str, opt: str, bad: str, good: str, *more: str) -> Build:
    """``command`` on the good inputs with ``opt`` set to ``bad`` (or ``good``)."""
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        g, ck = str(base["good"]), str(base["ckpt"])
        value = bad if is_bad else good
        args = {
            "check": ["check", g, "--samples", "1", "--dtype", "float64"],
            "match": ["match", g, ck, "--model", g, "--out", "out", "--rounds", "1"],
            "merge": ["merge", g, ck, "--model", g, "--out", "out", "--rounds", "1"],
            "barrier": ["barrier", g, ck, "--model", g, "--data", f"text:{base['text']}", "--points", "2", "--max-samples", "4"],
            "universe": ["universe", g, ck, "--model", g, "--out", "out", "--rounds", "1"],
        }[command]
        return [*args, opt, value, *more]

    return build


def learned(command: str, opt: str, bad: str, good: str) -> Build:
    """``command --method learned`` (two steps on the word text) with ``opt`` set to
    ``bad`` (or ``good``): learned matching's own flags are refused for other methods."""
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        steps = [] if opt in ("--steps", "--epochs") else ["--steps", "2"]
        return option(command, opt, bad, good, "--method", "learned", "--data", f"text:{base['text']}", *steps)(work, base, is_bad)

    return build


def every_command(make: Callable[[Path, Files, bool], Path], command: str) -> Build:
    """``command`` with the model file ``make`` builds as its first model."""
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        f, g, ck = str(make(work, base, is_bad)), str(base["good"]), str(base["ckpt"])
        return {
            "check": ["check", f, "--samples", "1", "--dtype", "float64"],
            "match": ["match", f, ck, "--model", g, "--out", "out", "--rounds", "1"],
            "barrier": ["barrier", f, ck, "--model", g, "--data", f"text:{base['text']}", "--points", "2", "--max-samples", "4"],
            "universe": ["universe", f, ck, "--model", g, "--out", "out", "--rounds", "1"],
        }[command]

    return build


def empty_checkpoint(suffix: str) -> Build:
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        p = work / f"b{suffix}"
        if is_bad:
            p.write_bytes(b"")
        else:
            from safetensors.torch import save_file

            sd = {k: v.clone() for k, v in load_model(base["good"]).model.state_dict().items()}
            save_file(sd, str(p)) if suffix == ".safetensors" else torch.save(sd, p)
        return ["match", str(base["good"]), str(p), "--model", str(base["good"]), "--out", "out", "--rounds", "1"]

    return build


def nonfinite_checkpoint(value: float) -> Build:
    """``check CKPT --model good.py`` where one weight of the checkpoint is ``value``."""
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        sd = dict(torch.load(base["ckpt"], weights_only=True))
        if is_bad:
            name = "transformer.h.0.mlp.c_fc.weight"
            sd[name] = sd[name].clone()
            sd[name][0, 0] = value
        p = work / "weights.pt"
        torch.save(sd, p)
        return ["check", str(p), "--model", str(base["good"]), "--samples", "1", "--dtype", "float64"]

    return build


#: a nanoGPT with an integer buffer of its own (position ids), saved in its checkpoints
POSITION_IDS = "\n_b = build\ndef build(**kw):\n    m = _b(**kw)\n    m.register_buffer('position_ids', torch.arange(16))\n    return m\n"


def integer_checkpoint(command: str, suffix: str = ".pt") -> Build:
    """``command`` with a checkpoint whose floating-point weights were cast to int64 (it
    was matched and written as float32 without a word). The good variant is the same
    checkpoint uncast: the model's own integer buffer is an integer there too."""
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        f = extra_file("posids.py", POSITION_IDS, POSITION_IDS)(work, base, is_bad)
        sd = {k: v.clone() for k, v in load_model(f).model.state_dict().items()}
        if is_bad:
            sd = {k: v.to(torch.int64) if v.is_floating_point() else v for k, v in sd.items()}
        ck = work / f"ints{suffix}"
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(sd, str(ck))
        else:
            torch.save(sd, ck)
        m, c = str(f), str(ck)
        return {
            "check": ["check", c, "--model", m, "--samples", "1", "--dtype", "float64"],
            "match": ["match", m, c, "--model", m, "--out", "out", "--rounds", "1"],
            "merge": ["merge", m, c, "--model", m, "--out", "out", "--rounds", "1"],
            "barrier": ["barrier", m, c, "--model", m, "--data", f"text:{base['text']}", "--points", "2", "--max-samples", "4"],
            "universe": ["universe", c, m, "--model", m, "--out", "out", "--rounds", "1"],  # the checkpoint first: the reference
        }[command]

    return build


def hf_integer_weights(work: Path, base: Files, is_bad: bool) -> list[str]:
    """``check`` on a copy of the GPT-2 folder whose weights were cast to int64
    (from_pretrained cast them back to float32 without a word)."""
    from safetensors.torch import load_file, save_file

    folder = work / "hf"
    shutil.copytree(hf_folder(base), folder)
    if is_bad:
        weights = folder / "model.safetensors"
        sd = {k: v.to(torch.int64) if v.is_floating_point() else v for k, v in load_file(str(weights)).items()}
        save_file(sd, str(weights), metadata={"format": "pt"})
    return ["check", str(folder), "--samples", "1", "--dtype", "float64"]


def hf_config(edit: Callable[[dict], object] | bytes) -> Build:
    """``check`` on a copy of the GPT-2 folder whose config.json is edited (a function of
    the parsed config giving the new JSON value, or raw bytes)."""
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        folder = work / "hf"
        shutil.copytree(hf_folder(base), folder)
        if is_bad:
            cfg = folder / "config.json"
            if isinstance(edit, bytes):
                cfg.write_bytes(edit)
            else:
                cfg.write_text(json.dumps(edit(json.loads(cfg.read_text()))))
        return ["check", str(folder), "--samples", "1", "--dtype", "float64"]

    return build


def mnist(work: Path, corrupt: bool = False) -> Path:
    """An MNIST folder of 40 random 8x8 images; with ``corrupt``, the images file is a
    gzip whose header is valid and whose deflate stream is not."""
    folder = work / "mnist"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    images = write_idx(folder / "t10k-images-idx3-ubyte.gz", torch.randint(0, 256, (40, 8, 8), generator=g, dtype=torch.uint8))
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", torch.randint(0, 10, (40,), generator=g).to(torch.uint8))
    if corrupt:
        raw = bytearray(images.read_bytes())
        raw[12:] = bytes(range(256)) * 2
        images.write_bytes(bytes(raw))
    return folder


def mnist_gz(work: Path, base: Files, is_bad: bool) -> list[str]:
    """``barrier`` of the ViT on an MNIST folder whose images file is a corrupted gzip."""
    return ["barrier", str(base["vit"]), str(base["vit"]), "--data", f"mnist:{mnist(work, is_bad)}", "--points", "2"]


def image_size(work: Path, base: Files, is_bad: bool) -> list[str]:
    """``barrier`` of the ViT on MNIST resized to an absurd size (it was resized in memory
    before the model's own size was compared)."""
    return ["barrier", str(base["vit"]), str(base["vit"]), "--data", f"mnist:{mnist(work)},size={10**6 if is_bad else 8}",
            "--points", "2"]


def images_for_a_gpt(command: str, *more: str) -> Build:
    """``command`` on the nanoGPT pair with MNIST images as --data (the good variant: the
    word text): the embedding's "Expected tensor for argument #1 'indices'" traceback."""
    def build(work: Path, base: Files, is_bad: bool) -> list[str]:
        data = f"mnist:{mnist(work)}" if is_bad else f"text:{base['text']}"
        g, ck = str(base["good"]), str(base["ckpt"])
        if command == "barrier":
            return ["barrier", g, ck, "--model", g, "--data", data, "--points", "2", "--max-samples", "4", *more]
        return [command, g, ck, "--model", g, "--out", "out", "--rounds", "1", "--data", data, *more]

    return build


def text_for_a_vit(work: Path, base: Files, is_bad: bool) -> list[str]:
    """``barrier`` of the ViT on the word text (token ids for a model that reads images)."""
    data = f"text:{base['text']},block=8" if is_bad else f"mnist:{mnist(work)}"
    return ["barrier", str(base["vit"]), str(base["vit"]), "--data", data, "--points", "2", "--align", "activation"]


def model_list(work: Path, base: Files, is_bad: bool) -> list[str]:
    """``universe @models.txt`` where the list file is a binary file (a checkpoint given with @)."""
    listing = work / "models.txt"
    if is_bad:
        listing.write_bytes(base["ckpt"].read_bytes())
    else:
        listing.write_text(f"{base['good']}\n{base['ckpt']}\n")
    return ["universe", f"@{listing}", "--model", str(base["good"]), "--out", "out", "--rounds", "1"]


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_address(work: Path, base: Files, is_bad: bool) -> list[str]:
    """``universe --ray HOST:PORT`` at a closed port (the good variant runs without Ray: a
    reachable address is tested on its own below, without starting a cluster)."""
    args = ["universe", str(base["good"]), str(base["ckpt"]), "--model", str(base["good"]), "--out", "out", "--rounds", "1"]
    return [*args, "--ray", f"127.0.0.1:{closed_port()}"] if is_bad else args


#: a data() hook for barrier's --data hook, with the body given
DATA_HOOK = """

def data(split, batch_size=64, max_samples=None, seed=0, model=None):
    {body}
"""
GOOD_BATCHES = "g = torch.Generator().manual_seed(0)\n    return [(torch.randint(11, (2, 8), generator=g), torch.randint(11, (2, 8), generator=g))]"
#: a GPT whose forward refuses float64 (it runs in its own float32, so it loads and runs)
FLOAT32_ONLY = """
_b = build


def build(**kw):
    m = _b(**kw)
    base = type(m)

    class GPT(base):
        def forward(self, *a, **k):
            y = base.forward(self, *a, **k)
            if y.dtype != torch.float32:
                raise TypeError(f"computes in float32 only, got {y.dtype}")
            return y

    m.__class__ = GPT
    return m
"""
FORWARD = "the model's forward failed on its example inputs"
RTOL = "between 0 and 1"

CASES = [
    # checkpoints and model files
    Case("match-empty-pt", empty_checkpoint(".pt"), "b.pt", "the file is empty"),
    Case("match-empty-safetensors", empty_checkpoint(".safetensors"), "b.safetensors", "the file is empty"),
    Case("check-inputs-wrong-shape", check_file("shape.py", "\ndef example_inputs(model, batch=2, seed=0):\n"
                                                            "    return (torch.zeros(batch, 3, 5, dtype=torch.long),)\n"),
         "shape.py", FORWARD),
    Case("check-inputs-out-of-vocabulary", check_file("vocab.py", "\ndef example_inputs(model, batch=2, seed=0):\n"
                                                                  "    return (torch.full((batch, 4), 10**6),)\n"),
         "vocab.py", FORWARD),
    Case("check-forward-returns-a-string", check_file("text_out.py", "\n_b = build\ndef build(**kw):\n    m = _b(**kw)\n"
                                                                      "    m.forward = lambda *a, **k: 'logits'\n    return m\n"),
         "text_out.py", "forward returned a str"),
    Case("check-forward-returns-int-tensor", check_file("int_out.py", "\n_b = build\ndef build(**kw):\n    m = _b(**kw)\n"
                                                                       "    f = m.forward\n"
                                                                       "    m.forward = lambda *a, **k: f(*a, **k).argmax(-1)\n"
                                                                       "    return m\n"),
         "int_out.py", "forward returned a torch.int64 tensor"),
    Case("check-forward-fails-in-float64", check_file("f64.py", FLOAT32_ONLY), "f64.py",
         "the model's forward failed in float64 on the example inputs: TypeError: computes in float32 only"),
    Case("check-example-inputs-raise", check_file("raises.py", "\ndef example_inputs(model, batch=2, seed=0):\n"
                                                               "    raise KeyError('tokenizer')\n"),
         "raises.py", "example_inputs() failed: KeyError"),
    Case("check-nan-weights", check_file("nan.py", "\n_b = build\ndef build(**kw):\n    m = _b(**kw)\n    with torch.no_grad():\n"
                                                   "        m.transformer.h[0].attn.c_proj.weight[1, 2] = float('nan')\n    return m\n"),
         "nan.py", "NaN or inf weights in transformer.h.0.attn.c_proj.weight"),
    Case("check-inf-weights-in-checkpoint", nonfinite_checkpoint(float("inf")), "weights.pt",
         "NaN or inf weights in transformer.h.0.mlp.c_fc.weight"),
    # integer weights where the model has floats: once cast to float32 and written without a word
    *(Case(f"{cmd}-int64-weights{suffix.replace('.', '-')}", integer_checkpoint(cmd, suffix), f"ints{suffix}",
           "transformer.wte.weight holds torch.int64 weights where the model has float32")
      for cmd, suffix in (("check", ".pt"), ("match", ".pt"), ("match", ".safetensors"), ("merge", ".pt"),
                          ("barrier", ".pt"), ("universe", ".pt"))),
    Case("check-rtol-in-model-file", check_file("rtol.py", "\nCHECK_RTOL = {'float64': float('nan')}\n",
                                                "\nCHECK_RTOL = {'float64': 1e-8}\n"),
         "rtol.py", "CHECK_RTOL"),
    # a model file that calls sys.exit(0) or os._exit(0): once exit 0 without a word, in every command
    *(Case(f"{cmd}-model-file-{how}-at-import", every_command(extra_file("quits.py", f"\nimport os, sys\n{call}\n"), cmd),
           "quits.py", f"importing the model file failed: it called {call}")
      for how, call in (("exits", "sys.exit(0)"), ("os-exits", "os._exit(0)")) for cmd in ("check", "match", "barrier", "universe")),
    *(Case(f"{cmd}-build-os-exits", every_command(extra_file("quits.py", "\n_b = build\ndef build(**kw):\n    import os\n"
                                                                         "    os._exit(0)\n"), cmd),
           "quits.py", "build() failed: it called os._exit(0)") for cmd in ("check", "match", "barrier", "universe")),
    Case("check-build-exits", check_file("quits.py", "\n_b = build\ndef build(**kw):\n    import sys\n    sys.exit(0)\n"),
         "quits.py", "build() failed: it called sys.exit(0)"),
    Case("check-example-inputs-os-exit", check_file("quits.py", "\ndef example_inputs(model, batch=2, seed=0):\n"
                                                                "    import os\n    os._exit(3)\n"),
         "quits.py", "example_inputs() failed: it called os._exit(3)"),
    Case("check-example-inputs-exit", check_file("quits.py", "\ndef example_inputs(model, batch=2, seed=0):\n"
                                                             "    raise SystemExit(3)\n"),
         "quits.py", "example_inputs() failed: it called sys.exit(3)"),
    *(Case(f"barrier-data-hook-{how}", lambda work, base, bad, call=call: [
        "barrier", str(extra_file("hooked.py", DATA_HOOK.format(body=f"import os, sys\n    {call}"),
                                  DATA_HOOK.format(body=GOOD_BATCHES))(work, base, bad)),
        str(base["ckpt"]), "--data", "hook", "--points", "2"],
           "hooked.py", f"data('val') failed: it called {call}") for how, call in (("exits", "sys.exit(0)"), ("os-exits", "os._exit(0)"))),
    # Hugging Face folders
    Case("hf-config-is-a-list", hf_config(lambda cfg: [cfg]), "config.json", "the config is a JSON list"),
    Case("hf-architectures-not-names", hf_config(lambda cfg: {**cfg, "architectures": [123]}), "config.json",
         "'architectures' is [123]"),
    Case("hf-architectures-not-a-model", hf_config(lambda cfg: {**cfg, "architectures": ["GPT2Config"]}), "config.json",
         "transformers has no model class 'GPT2Config'"),
    Case("hf-config-not-text", hf_config(b"\xff\xfe\x00\x01binary"), "config.json", "unreadable config"),
    Case("hf-int64-weights", hf_integer_weights, "model.safetensors",
         "transformer.wte.weight holds torch.int64 weights where the model has float32"),
    # data files
    Case("barrier-mnist-corrupted-gzip", mnist_gz, "t10k-images-idx3-ubyte.gz", "a corrupted gzip file"),
    Case("universe-binary-model-list", model_list, "models.txt", "not a text list of model paths"),
    # data of the wrong kind for the model: one line naming the source and what the model reads
    Case("match-activation-images-for-a-gpt", images_for_a_gpt("match", "--method", "activation"), "mnist:",
         "the data gives images (float32 tensors of 1x8x8 per example), but model A (GPT) takes token ids"),
    Case("merge-learned-images-for-a-gpt", images_for_a_gpt("merge", "--method", "learned", "--steps", "2"), "mnist:",
         "takes token ids (integers, read by its embedding transformer.wte)"),
    Case("barrier-images-for-a-gpt", images_for_a_gpt("barrier"), "mnist:", "good.py takes token ids"),
    Case("barrier-weight-activation-images-for-a-gpt", images_for_a_gpt("barrier", "--align", "weight+activation"),
         "mnist:", "the data gives images"),
    Case("barrier-text-for-a-vit", text_for_a_vit, "text:",
         "vit.py takes images (floating-point values, read by its Conv2d patch_embed)"),
    # option values: nan, inf and negative numbers where they mean nothing, absurd sizes
    Case("merge-alpha-nan", option("merge", "--alpha", "nan", "0.5"), "--alpha", "not a finite number"),
    Case("merge-alpha-inf", option("merge", "--alpha", "inf", "1"), "--alpha", "not a finite number"),
    Case("merge-alpha-above-1", option("merge", "--alpha", "1.5", "1"), "--alpha"),
    Case("match-tol-nan", option("match", "--tol", "nan", "0"), "--tol", "not a finite number"),
    Case("merge-tol-inf", option("merge", "--tol", "inf", "1e-3"), "--tol", "not a finite number"),
    Case("check-rtol-negative", option("check", "--rtol", "float64=-1e-9", "float64=1e-8"), "--rtol", RTOL),
    Case("check-rtol-nan", option("check", "--rtol", "float64=nan", "float64=1e-8"), "--rtol", RTOL),
    Case("check-rtol-inf", option("check", "--rtol", "float32=inf", "float32=1e-3", "--dtype", "float32"), "--rtol", RTOL),
    Case("check-rtol-zero", option("check", "--rtol", "float64=0", "float64=1e-8"), "--rtol", RTOL),
    Case("check-seed-negative", option("check", "--seed", "-1", "1"), "--seed"),
    Case("check-seed-too-large", option("check", "--seed", str(2**64), str(2**32 - 1)), "--seed"),
    Case("check-batch-absurd", option("check", "--batch", "1000000000", "3"), "--batch"),
    Case("barrier-points-absurd", option("barrier", "--points", "100000000000", "3"), "--points"),
    Case("universe-tol-nan", option("universe", "--tol", "nan", "0"), "--tol", "not a finite number"),
    Case("universe-tol-negative", option("universe", "--tol", "-1", "0"), "--tol"),
    Case("universe-rounds-absurd", option("universe", "--rounds", "1000000000000", "2"), "--rounds"),
    Case("universe-jobs-absurd", option("universe", "--jobs", "100000000", "1"), "--jobs"),
    Case("universe-threads-absurd", option("universe", "--threads", "100000000", "1"), "--threads"),
    Case("universe-start-out-of-range", option("universe", "--start", "99", "1"), "--start 99", "not a model's index"),
    Case("universe-simplex-resolution-absurd",
         lambda work, base, bad: option("universe", "--resolution", "1000000", "2", "--data", f"text:{base['text']}",
                                        "--max-samples", "4")(work, base, bad),
         "--resolution", "grid points"),
    Case("universe-batch-size-absurd",
         lambda work, base, bad: option("universe", "--batch-size", "100000000", "8", "--data", f"text:{base['text']}",
                                        "--max-samples", "4")(work, base, bad),
         "--batch-size", "exhausts memory"),
    Case("barrier-image-size-absurd", image_size, "size", "must be at most 1024"),
    # seeds past 64 bits failed deep in torch ("Overflow when unpacking long long"); steps
    # and sizes past any sensible range ran until killed: each bound says why it is there
    Case("match-learned-seed-too-large", learned("match", "--seed", str(2**70), "1"), "--seed", "64-bit random generators"),
    Case("merge-learned-seed-negative", learned("merge", "--seed", "-1", "0"), "--seed"),
    Case("universe-learned-seed-too-large", learned("universe", "--seed", str(2**70), "1"), "--seed",
         "64-bit random generators"),
    Case("match-learned-steps-absurd", learned("match", "--steps", str(2**64), "2"), "--steps", "runs for weeks"),
    Case("universe-learned-steps-absurd", learned("universe", "--steps", str(10**12), "2"), "--steps", "runs for weeks"),
    Case("match-learned-epochs-absurd", learned("match", "--epochs", "1e12", "0.01"), "--epochs", "runs for weeks"),
    Case("match-learned-batch-size-absurd", learned("match", "--batch-size", str(2**64), "4"), "--batch-size",
         "exhausts memory"),
    Case("match-lift-free-absurd", option("match", "--lift-free", str(10**12), "0"), "--lift-free", "runs for weeks"),
    Case("barrier-lift-free-absurd", option("barrier", "--lift-free", str(2**64), "0"), "--lift-free", "runs for weeks"),
    # vanilla averaging aligns nothing: its certificate was a KeyError on the first space
    Case("match-certify-method-none", option("match", "--method", "none", "weight", "--certify"), "--certify",
         "--method none aligns nothing"),
    Case("barrier-batch-size-absurd", option("barrier", "--batch-size", str(10**12), "4"), "--batch-size", "exhausts memory"),
    # an unreachable Ray cluster: ray.init retried it for minutes
    Case("universe-ray-unreachable", ray_address, "--ray 127.0.0.1:", "cannot reach", seconds=RAY_CONNECT_TIMEOUT + 3),
]


def tree(folder: Path) -> list[str]:
    """Every file and folder under ``folder`` (hidden ones too), relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@attrs.frozen
class Outcome:
    code: int
    out: str
    err: str
    seconds: float
    #: every path under the row's tmp_path once its input was built, and after the command
    before: list[str]
    after: list[str]


class RealExitReached(BaseException):
    """os._exit was called outside symspec's guard (it would have ended the process)."""


def _real_exit_reached(code: int = 0) -> None:
    raise RealExitReached(code)


def run_case(case: Case, base: Files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: bool) -> Outcome:
    """Build the row's input in ``tmp_path/inputs``, run the command in the empty
    ``tmp_path/cwd`` (where its relative --out points)."""
    work, cwd = tmp_path / "inputs", tmp_path / "cwd"
    work.mkdir()
    cwd.mkdir()
    args = case.build(work, base, bad)
    before = tree(tmp_path)
    monkeypatch.chdir(cwd)
    # an os._exit that reaches the real one would end pytest itself with exit 0: stand in for it
    monkeypatch.setattr(os, "_exit", _real_exit_reached)
    t0 = time.perf_counter()
    code, out, err = run(*args)
    return Outcome(code, out, err, time.perf_counter() - t0, before, tree(tmp_path))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_exits_2_with_one_error_line_naming_it(case: Case, base: Files, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tree(base["dir"])
    r = run_case(case, base, tmp_path, monkeypatch, bad=True)
    assert r.code == 2, (r.out, r.err)
    lines = r.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err
    assert case.culprit in lines[0] and case.says in lines[0], lines[0]
    assert "Traceback" not in r.err and "Traceback" not in r.out
    assert r.after == r.before, "the failed command wrote files"
    assert tree(base["dir"]) == shared
    if case.seconds is not None:
        assert r.seconds < case.seconds, f"took {r.seconds:.1f} s"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_same_command_on_good_input_exits_0(case: Case, base: Files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = run_case(case, base, tmp_path, monkeypatch, bad=False)
    assert r.code == 0, (r.out, r.err)


# -- the same refusals from Python ------------------------------------------------------------

def test_check_refuses_what_it_cannot_compare() -> None:
    from symspec import check, load_spec
    from symspec.errors import SymspecInputError
    from tests.zoo import ZOO

    model, inputs = ZOO["nanogpt"](n_layer=1)
    spec = load_spec("nanogpt")
    assert check(model, spec, inputs, samples=1, dtypes=["float64"]).passed  # the control
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.bias[3] = float("inf")
    with pytest.raises(SymspecInputError, match=r"^model GPT has NaN or inf weights in transformer\.h\.0\.mlp\.c_proj\.bias$"):
        check(model, spec, inputs, samples=1, dtypes=["float64"])
    with pytest.raises(SymspecInputError, match=r"^model gpt\.py has NaN or inf weights"):
        check(model, spec, inputs, samples=1, dtypes=["float64"], source="gpt.py")
    model, inputs = ZOO["nanogpt"](n_layer=1)
    forward = model.forward
    model.forward = lambda *a, **k: forward(*a, **k).argmax(-1)  # type: ignore[method-assign]
    with pytest.raises(SymspecInputError, match=r"^gpt\.py: the model's output holds no floating-point tensor"):
        check(model, spec, inputs, samples=1, dtypes=["float64"], source="gpt.py")


# -- the Ray address check on its own ---------------------------------------------------------

def test_ray_address_check_accepts_a_listening_port_and_refuses_a_closed_one() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_ray_address(f"127.0.0.1:{port}")
        check_ray_address(f"ray://localhost:{port}")
    from symspec.errors import SymspecInputError

    t0 = time.perf_counter()
    with pytest.raises(SymspecInputError, match=r"cannot reach 127\.0\.0\.1"):
        check_ray_address(f"127.0.0.1:{closed_port()}")
    assert time.perf_counter() - t0 < RAY_CONNECT_TIMEOUT + 3
    with pytest.raises(SymspecInputError, match="not an address"):
        check_ray_address("head:port")


def test_ray_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_endpoint("local") is None and ray_endpoint("auto") is None
    assert ray_endpoint("ray://head") == ("head", 10001) and ray_endpoint("10.1.2.3") == ("10.1.2.3", 6379)
    assert ray_endpoint("[::1]:6380") == ("::1", 6380)
    monkeypatch.setenv("RAY_ADDRESS", "head:7000")
    assert ray_endpoint("auto") == ("head", 7000)  # what ray.init("auto") connects to


def test_ray_executor_checks_the_address_before_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = optional("ray")
    from symspec.errors import SymspecInputError
    from symspec.runtime import RayExecutor

    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process (its address is used as it is)")
    called = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: called.append(a))
    with pytest.raises(SymspecInputError, match="cannot reach"):
        RayExecutor(f"127.0.0.1:{closed_port()}", jobs=1)
    assert called == []
