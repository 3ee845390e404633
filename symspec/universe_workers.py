"""The work units of universe matching and the executors that run them.

A round of universe matching is a set of independent tasks, one per model, that talk to
the parent only through files in the run's work folder and a small JSON-able result:

- ``prepare``: load a model from its source (model file, Hugging Face folder,
  checkpoint + factory), bind the spec, check that it has the reference's architecture,
  bring it into canonical form and write it (``canonical/NN.safetensors``);
- ``align``: read a canonical model, the current universe and the model's element of
  the previous round (the warm start), run weight matching of the model onto the
  universe, and write the aligned model and its elements.

Every output is written to a temporary name and renamed, and a task's ``done`` marker
(its result, as JSON) is written last: a task whose marker exists is complete, so an
interrupted run resumes where it stopped.

Three executors run a list of tasks and hand each result back as it completes:
:class:`InlineExecutor` (this process), :class:`ProcessExecutor` (``jobs`` worker
processes, each holding one model at a time; a worker that dies is attributed to its
task and replaced) and :class:`RayExecutor` (Ray tasks on a cluster; the work folder and
the models must be on a filesystem every node reads). A task never raises: expected
errors (a model that does not fit) and unexpected ones come back as ``ok: False``
results naming the model, and the parent decides.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import attrs
import torch

from .errors import SymspecInputError

Result = dict[str, Any]
OnDone = Callable[["Task", Result], None]


class UniverseError(SymspecInputError):
    """Models that cannot be matched together, or a run that failed (exit code 2)."""


@attrs.frozen
class RunConfig:
    """What every task of a run needs besides its own files (pickled once per run)."""

    bound: Any  # symspec.binding.BoundSpec of the reference model
    modes: dict[str, str]  # space -> "full" | "perm" | "fixed"
    #: the reference's canonical state: name -> (shape, dtype, floating)
    signature: dict[str, tuple[tuple[int, ...], str, bool]]
    reference: str
    factory: str | None
    dtype: str
    device: str = "cpu"
    match_rounds: int = 10
    match_tol: float = 1e-6
    max_iter: int = 10
    threads: int = 1


@attrs.frozen
class Task:
    """One unit of work; every path is a file in the run's work folder (or a model source)."""

    kind: str  # "prepare" | "align"
    index: int
    name: str
    run: str  # the pickled RunConfig
    source: str = ""  # prepare: the model to load
    canonical: str = ""  # prepare: written; align: read
    universe: str = ""
    init: str = ""  # align: the previous round's elements ("" = start from the identity)
    aligned: str = ""
    elements: str = ""
    done: str = ""  # the result as JSON, written last


# --------------------------------------------------------------------------- files


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file atomically (tied entries are stored as separate copies)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, Any]] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        t = v.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[k] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        save_file(out, str(tmp), metadata=dict(metadata) if metadata else None)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def write_json(path: str | Path, data: Any) -> None:
    from .io_util import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def save_elements(path: str | Path, searched: Mapping[str, Mapping[str, torch.Tensor]],
                  full: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Elements of the searched groups (the next round's warm start) and of the spec's
    full groups (the transform record), as ``{searched|full}/{space}/{field}``."""
    tensors = {f"searched/{s}/{k}": v for s, e in searched.items() for k, v in e.items()}
    tensors.update({f"full/{s}/{k}": v for s, e in full.items() for k, v in e.items()})
    save_tensors(path, tensors)


def load_elements(path: str | Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    parts: dict[str, dict[str, dict[str, torch.Tensor]]] = {"searched": {}, "full": {}}
    for key, v in load_tensors(path).items():
        which, space, field = key.split("/", 2)
        parts[which].setdefault(space, {})[field] = v
    return parts["searched"], parts["full"]


# --------------------------------------------------------------------------- architecture checks


def state_signature(sd: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."), bool(v.is_floating_point())) for k, v in sd.items()}


def signature_differences(ref: Mapping[str, tuple[tuple[int, ...], str, bool]],
                          other: Mapping[str, tuple[tuple[int, ...], str, bool]]) -> list[str]:
    out = []
    for k in sorted(set(ref) | set(other)):
        if k not in other:
            out.append(f"{k} is missing")
        elif k not in ref:
            out.append(f"{k} is not in the reference")
        elif tuple(ref[k][0]) != tuple(other[k][0]) or ref[k][2] != other[k][2]:
            out.append(f"{k} has shape {list(other[k][0])} ({other[k][1]}) here but {list(ref[k][0])} ({ref[k][1]}) in the reference")
    return out


def architecture_error(name: str, reference: str, problems: list[str]) -> UniverseError:
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return UniverseError(f"{name} does not share the architecture of {reference}: " + "; ".join(problems[:5]) + more)


# --------------------------------------------------------------------------- tasks

_CONFIGS: dict[tuple[str, int], tuple[RunConfig, Any]] = {}
_SETUP_DONE: set[str] = set()


def _config(path: str) -> tuple[RunConfig, Any]:
    """The run's config and its searched (restricted) problem, cached per process."""
    key = (path, Path(path).stat().st_mtime_ns)
    if key not in _CONFIGS:
        from .solvers import restrict_problem

        with open(path, "rb") as f:
            cfg: RunConfig = pickle.load(f)
        _CONFIGS.clear()
        _CONFIGS[key] = (cfg, restrict_problem(cfg.bound.problem, cfg.modes))
    return _CONFIGS[key]


def run_setup(setup: str | None) -> None:
    """Call a ``module:function`` once per process (custom groups, solvers, logging)."""
    if not setup or setup in _SETUP_DONE:
        return
    module, _, fn = setup.partition(":")
    getattr(importlib.import_module(module), fn or "setup")()
    _SETUP_DONE.add(setup)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch threads (restored after): the same count in every executor
    keeps results bitwise identical, whichever process computes them."""
    before = torch.get_num_threads()
    if n > 0 and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def run_task(task: Task, setup: str | None = None) -> Result:
    """Run one task; never raises (failures come back as ``{"ok": False, "error": ...}``)."""
    start = time.perf_counter()
    try:
        run_setup(setup)
        cfg, searched = _config(task.run)
        with torch_threads(cfg.threads):
            result = (prepare if task.kind == "prepare" else align)(task, cfg, searched)
    except SymspecInputError as e:
        return {"ok": False, "index": task.index, "name": task.name, "input": True, "error": str(e)}
    except Exception as e:  # a bug or an environment problem: report it with where it happened
        where = traceback.extract_tb(e.__traceback__)[-1]
        return {"ok": False, "index": task.index, "name": task.name, "input": False,
                "error": f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})"}
    result.update(ok=True, index=task.index, name=task.name, seconds=time.perf_counter() - start, pid=os.getpid())
    write_json(task.done, result)
    return result


def prepare_state(cfg: RunConfig, name: str, state: Mapping[str, torch.Tensor], bound: Any) -> dict[str, torch.Tensor]:
    """Check a bound model against the reference and return its canonical state in the
    run's dtype (raises SymspecInputError naming the model)."""
    from .match import check_finite
    from .solvers.weight import widen
    from .transforms import canonicalize_state_dict

    problems = bound.problem.differences(cfg.bound.problem, "here", "in the reference")
    if problems:
        raise architecture_error(name, cfg.reference, problems)
    check_finite(state, name)
    canonical = canonicalize_state_dict(bound, widen(state))  # float16/bfloat16: in float32
    check_finite(canonical, f"{name} (canonical form)")
    dtype = getattr(torch, cfg.dtype)
    canonical = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()) for k, v in canonical.items()}
    problems = signature_differences(cfg.signature, state_signature(canonical))
    if problems:
        raise architecture_error(name, cfg.reference, problems)
    return canonical


def prepare(task: Task, cfg: RunConfig, searched: Any) -> Result:
    from .binding import bind
    from .loading import load_model, source_dtype

    try:
        loaded = load_model(task.source, factory=cfg.factory)
        bound = bind(cfg.bound.spec, loaded.model)
    except SymspecInputError as e:
        text = str(e)
        raise SymspecInputError(text if task.source in text else f"{task.name}: {text}") from e
    state = {k: v.detach() for k, v in loaded.model.state_dict().items()}
    canonical = prepare_state(cfg, task.name, state, bound)
    save_tensors(task.canonical, canonical)
    return {"format": loaded.format, "class": type(loaded.model).__name__, "dtype": source_dtype(loaded)}


def align(task: Task, cfg: RunConfig, searched: Any) -> Result:
    from .match import weight_distance
    from .solvers import embed, match_weights
    from .transforms import apply_elements

    problem = cfg.bound.problem
    dtype = getattr(torch, cfg.dtype)
    theta = load_tensors(task.canonical)
    universe = load_tensors(task.universe)
    init = None
    start = theta
    if task.init:
        init, init_full = load_elements(task.init)
        start = apply_elements(problem, init_full, theta)
    before = weight_distance(cfg.bound, universe, start)
    del start
    res = match_weights(searched, universe, theta, rounds=cfg.match_rounds, tol=cfg.match_tol, device=cfg.device,
                        dtype=dtype, init=init, max_iter=cfg.max_iter, greedy_start=init is None)
    elements = {s: {k: v.detach().to("cpu") for k, v in e.items()} for s, e in res.elements.items()}
    full = {s: embed(problem.spaces[s].group, searched.spaces[s].group, e, dtype) for s, e in elements.items()}
    aligned = apply_elements(problem, full, theta)
    after = weight_distance(cfg.bound, universe, aligned)
    save_tensors(task.aligned, aligned)
    save_elements(task.elements, elements, full)
    return {"before": before, "after": after, "match_rounds": len(res.history) - 1, "converged": res.converged,
            "match_objective": res.history}


# --------------------------------------------------------------------------- executors


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


def crashed(task: Task, why: str) -> Result:
    return {"ok": False, "index": task.index, "name": task.name, "input": False, "crashed": True,
            "error": f"the worker process died while working on it ({why})"}


class InlineExecutor:
    """Runs the tasks one after the other in this process."""

    name = "inline"

    def __init__(self, setup: str | None = None) -> None:
        self.setup = setup
        self.max_in_flight = 0

    def run(self, tasks: list[Task], on_done: OnDone) -> None:
        for t in tasks:
            self.max_in_flight = max(self.max_in_flight, 1)
            on_done(t, run_task(t, self.setup))

    def close(self) -> None:
        pass


def serve(read_fd: int, write_fd: int) -> None:
    """A worker process's loop: run the tasks read from ``read_fd`` until told to stop.

    The first message carries the parent's ``sys.path`` and the setup hook. Workers are
    started as ``python -c`` (not multiprocessing's spawn), so a user's script needs no
    ``if __name__ == "__main__"`` guard and is never re-imported in the workers.
    """
    import sys
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    rx = Connection(read_fd, writable=False)
    tx = Connection(write_fd, readable=False)
    try:
        hello = rx.recv()
    except (EOFError, OSError):
        return
    sys.path[:0] = [p for p in hello["sys_path"] if p not in sys.path]
    setup = hello.get("setup")
    while True:
        try:
            task = rx.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        tx.send(run_task(task, setup))


@attrs.define(eq=False)
class _Worker:
    process: Any  # subprocess.Popen
    rx: Any  # Connection: results from the worker
    tx: Any  # Connection: tasks to the worker


class ProcessExecutor:
    """``jobs`` worker processes, each running one task at a time.

    Each worker has its own pipes, so a worker that dies (killed for memory, a segfault)
    is known by the task it held: that task fails with the exit status, the worker is
    replaced, and the other tasks carry on. Workers are reused across rounds; their
    standard output goes to standard error (``--json`` output stays clean).
    """

    name = "processes"

    def __init__(self, jobs: int, setup: str | None = None) -> None:
        self.jobs = max(1, int(jobs))
        self.setup = setup
        self.idle: list[_Worker] = []
        self.max_in_flight = 0

    def _start(self) -> _Worker:
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        task_r, task_w = os.pipe()
        res_r, res_w = os.pipe()
        code = f"from symspec.universe_workers import serve; serve({task_r}, {res_w})"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(task_r, res_w), stdin=subprocess.DEVNULL,
                                    stdout=2, close_fds=True)
        finally:
            os.close(task_r)
            os.close(res_w)
        w = _Worker(proc, Connection(res_r, writable=False), Connection(task_w, readable=False))
        w.tx.send({"sys_path": list(sys.path), "setup": self.setup})
        return w

    def run(self, tasks: list[Task], on_done: OnDone) -> None:
        from multiprocessing.connection import wait

        pending = deque(tasks)
        busy: dict[_Worker, Task] = {}
        try:
            while pending or busy:
                while pending and len(busy) < self.jobs:
                    w = self.idle.pop() if self.idle else self._start()
                    task = pending.popleft()
                    try:
                        w.tx.send(task)
                    except OSError:  # it died while idle: start another
                        self._drop(w)
                        pending.appendleft(task)
                        continue
                    busy[w] = task
                    self.max_in_flight = max(self.max_in_flight, len(busy))
                ready = set(wait([w.rx for w in busy]))
                for w in [w for w in busy if w.rx in ready]:
                    task = busy.pop(w)
                    try:
                        result = w.rx.recv()
                    except (EOFError, OSError):
                        result = None
                    if result is None:
                        with suppress(Exception):
                            w.process.wait(timeout=10)
                        why = describe_exit(w.process.returncode)
                        self._drop(w)
                        result = crashed(task, why)
                    else:
                        self.idle.append(w)
                    on_done(task, result)
        except BaseException:
            for w in busy:
                self._drop(w)
            raise

    def _drop(self, w: _Worker) -> None:
        for c in (w.rx, w.tx):
            with suppress(OSError):
                c.close()
        if w.process.poll() is None:
            w.process.kill()
        with suppress(Exception):
            w.process.wait(timeout=10)

    def close(self) -> None:
        for w in self.idle:
            with suppress(OSError):
                w.tx.send(None)
        for w in self.idle:
            with suppress(Exception):
                w.process.wait(timeout=10)
            self._drop(w)
        self.idle.clear()


def _ray_entry(task: Task, setup: str | None) -> Result:
    return run_task(task, setup)


#: seconds a --ray address gets to accept a connection: ray.init itself retries an
#: unreachable one for minutes
RAY_CONNECT_TIMEOUT = 5.0


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port ``ray.init(address=...)`` connects to: ``HOST:PORT`` (a cluster's
    GCS; port 6379 when none is given), ``ray://HOST[:PORT]`` (Ray Client; port 10001),
    ``auto`` with ``RAY_ADDRESS`` set (that address). None when Ray finds or starts the
    cluster itself (``local``, ``auto`` without ``RAY_ADDRESS``) or for a scheme other
    than ``ray://``, which is left to Ray.

    >>> ray_endpoint("ray://head:10001"), ray_endpoint("10.0.0.5:6379"), ray_endpoint("local")
    (('head', 10001), ('10.0.0.5', 6379), None)
    """
    from urllib.parse import urlsplit

    addr = address.strip()
    if addr == "auto":
        addr = os.environ.get("RAY_ADDRESS", "").strip() or "auto"
    if addr in ("auto", "local"):
        return None
    scheme, sep, rest = addr.partition("://")
    if not sep:
        scheme, rest = "", addr
    elif scheme != "ray":
        return None
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port
    except ValueError as e:  # a port that is not a number, or out of range
        raise SymspecInputError(f"--ray {address}: not an address ({e}); give HOST:PORT, ray://HOST:PORT, auto or local") from None
    if not host:
        raise SymspecInputError(f"--ray {address}: no host in the address; give HOST:PORT, ray://HOST:PORT, auto or local")
    return host, port or (10001 if scheme == "ray" else 6379)


def _this_machine_ip() -> str | None:
    """The address other machines reach this one at (a UDP socket's source address for a
    public destination; nothing is sent), or None offline."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is consulted
            return str(s.getsockname()[0])
    except OSError:
        return None


def check_ray_address(address: str, timeout: float = RAY_CONNECT_TIMEOUT) -> None:
    """Raise :class:`SymspecInputError` unless ``address`` (see :func:`ray_endpoint`)
    accepts a TCP connection within ``timeout`` seconds. ``ray.init`` retries an address
    that does not answer for minutes before it gives up; this says so in seconds."""
    import socket

    end = ray_endpoint(address)
    if end is None:
        return
    host, port = end
    hosts = [host]
    if host in ("localhost", "127.0.0.1", "::1"):
        # Ray replaces a loopback address by this machine's own before connecting
        own = _this_machine_ip()
        if own is not None and own not in hosts:
            hosts.append(own)
    reason = ""
    for h in hosts:
        try:
            with socket.create_connection((h, port), timeout=timeout):
                return
        except OSError as e:
            reason = e.strerror or str(e) or type(e).__name__
    raise SymspecInputError(f"--ray {address}: cannot reach {host}:{port} ({reason}); check the address and that "
                            "the Ray cluster is running")


class RayExecutor:
    """Ray tasks, at most ``jobs`` in flight (default: the cluster's CPUs).

    ``address``: ``"local"`` starts a single-node cluster in this process (``num_cpus =
    jobs``) and stops it on :meth:`close`; anything else (``"auto"``, ``"ray://host:10001"``,
    ``"host:6379"``) connects to a running cluster. If Ray is already initialised in this
    process, that session is used as it is. Tasks read and write the run's work folder,
    so it (and the models) must be on storage every node sees.
    """

    name = "ray"

    def __init__(self, address: str, jobs: int | None = None, setup: str | None = None, *, gpus: float = 0.0,
                 retries: int = 0) -> None:
        try:
            import ray
        except ImportError as e:
            raise SymspecInputError("--ray needs Ray: pip install 'symspec[ray]'") from e
        self.ray = ray
        self.owned = False
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if address == "local":
                kw["num_cpus"] = int(jobs or os.cpu_count() or 1)
            else:
                check_ray_address(address)
            try:
                ray.init(address=address, **kw)
            except Exception as e:
                raise SymspecInputError(f"--ray {address}: cannot connect to a Ray cluster: {type(e).__name__}: {e}") from e
            self.owned = True
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.jobs = max(1, int(jobs or cpus))
        self.setup = setup
        self.remote = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=retries)(_ray_entry)
        self.max_in_flight = 0

    def run(self, tasks: list[Task], on_done: OnDone) -> None:
        ray = self.ray
        pending = deque(tasks)
        refs: dict[Any, Task] = {}
        try:
            while pending or refs:
                while pending and len(refs) < self.jobs:
                    t = pending.popleft()
                    refs[self.remote.remote(t, self.setup)] = t
                    self.max_in_flight = max(self.max_in_flight, len(refs))
                done, _ = ray.wait(list(refs), num_returns=1)
                for ref in done:
                    task = refs.pop(ref)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.WorkerCrashedError:
                        result = crashed(task, "the Ray worker crashed")
                    except ray.exceptions.RayError as e:
                        result = {"ok": False, "index": task.index, "name": task.name, "input": False,
                                  "crashed": True, "error": f"the Ray task failed: {str(e).splitlines()[0][:300]}"}
                    on_done(task, result)
        except BaseException:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()
            self.owned = False


Executor = InlineExecutor | ProcessExecutor | RayExecutor


def make_executor(jobs: int | None = None, ray: str | None = None, setup: str | None = None, *, device: str = "cpu",
                  retries: int = 0) -> Executor:
    """Ray when ``ray`` names a cluster (``jobs`` tasks in flight, default: its CPUs),
    worker processes for ``jobs > 1``, else inline. A CUDA ``device`` makes each Ray
    task ask for one GPU."""
    if ray:
        gpus = 1.0 if str(device).startswith("cuda") else 0.0
        return RayExecutor(ray, jobs, setup, gpus=gpus, retries=retries)
    if jobs is not None and jobs > 1:
        return ProcessExecutor(jobs, setup)
    return InlineExecutor(setup)


__all__ = [
    "InlineExecutor",
    "ProcessExecutor",
    "RayExecutor",
    "RunConfig",
    "Task",
    "UniverseError",
    "check_ray_address",
    "load_elements",
    "load_tensors",
    "make_executor",
    "ray_endpoint",
    "run_task",
    "save_elements",
    "save_tensors",
]
