"""``--device``: one option type for every command that runs dense work somewhere, so
that each refuses the same bad values with the same words before any model is loaded."""

from __future__ import annotations

import re
from typing import Any

import click

_FORM = re.compile(r"cpu|cuda(?::(\d+))?")


class DeviceType(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N``; a CUDA device this machine does not have is
    refused here, naming the option (not as a traceback from the first tensor moved)."""

    name = "cpu|cuda[:N]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = str(value).strip()
        found = _FORM.fullmatch(text)
        if found is None:
            self.fail(f"{value!r} is no device here; use cpu, cuda or cuda:N", param, ctx)
        if text.startswith("cuda"):
            import torch  # deferred: `symspec --help` must not import torch

            if not torch.cuda.is_available():
                self.fail(f"{text}: CUDA is not available here (use --device cpu)", param, ctx)
            index = int(found.group(1) or 0)
            if index >= torch.cuda.device_count():
                self.fail(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"numbered from 0", param, ctx)
        return text


DEVICE = DeviceType()
