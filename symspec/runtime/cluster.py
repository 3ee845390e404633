"""Ray: the same tasks as Ray tasks on a cluster (:class:`RayExecutor`), and the check
that a cluster's address answers before ``ray.init`` spends minutes retrying it.

Tasks that exchange files need them on storage every node reads.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from ..errors import SymspecInputError
from .local import OnDone, crashed
from .task import Result, Task, failure, run_task


def _ray_entry(task: Task, setup: str | None) -> Result:
    """What a Ray worker runs (a module-level function: Ray pickles it by reference)."""
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
    process, that session is used as it is. Tasks that read and write files (universe
    matching's work folder, the models) need them on storage every node sees.
    """

    name = "ray"

    def __init__(self, address: str, jobs: int | None = None, setup: str | None = None, *, gpus: float = 0.0,
                 retries: int = 0) -> None:
        try:
            import ray  # optional: the ray extra
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
                        result = failure(task, f"the Ray task failed: {str(e).splitlines()[0][:300]}", input=False,
                                         crashed=True)
                    on_done(task, result)
        except BaseException:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()
            self.owned = False


__all__ = ["RAY_CONNECT_TIMEOUT", "RayExecutor", "check_ray_address", "ray_endpoint"]
