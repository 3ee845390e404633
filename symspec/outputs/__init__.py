"""Writing outputs without ever losing data: the primitives every command uses.

- :func:`check_outputs`, before any work: an output must not be, contain or lie inside
  one of the command's inputs (symlinks resolved, with or without ``--force``); an
  existing output needs ``--force``; a report path must not be a folder; the folder it
  goes into must be writable and the name short enough. It also says which staging
  folders an interrupted run left behind.
- :func:`publish`: each output is built in a staging folder next to it (a short fixed
  prefix and a random part, whatever the output's name, with a marker naming the output
  and the process), then renamed into place once every output is complete. Any failure
  or interrupt (``KeyboardInterrupt``, SIGTERM while publishing) removes the staging
  folders, the outputs already renamed (putting back what ``--force`` replaced) and the
  parent folders it made. A write failure (``OSError``, safetensors' serialisation error
  on a full disk) becomes one line: ``cannot write OUT: No space left on device``.
  Published files get the usual modes, ``0o666 & ~umask`` (folders ``0o777 & ~umask``).
- :class:`FolderLock`: an exclusive ``flock`` on a folder (``universe``'s resumable work
  folder): a second run fails with "another run is using ...", and a killed run's lock
  goes with its process. A folder that is a symbolic link is never followed.
- :func:`atomic_write` (and :func:`atomic_write_bytes`, :func:`atomic_write_text`): one
  file or folder, built at a temporary sibling and renamed into place.

The package: :mod:`~symspec.outputs.checks` (before any work), :mod:`~symspec.outputs.publishing`,
:mod:`~symspec.outputs.atomic`, :mod:`~symspec.outputs.lock` (work folders) and
:mod:`~symspec.outputs.base` (what they share).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> out = d / "result"
>>> check_outputs([Target(out, "--out", folder=True)], inputs=[], force=False)
[]
>>> publish([(Target(out, "--out", folder=True), lambda p: (p / "a.txt").write_text("hi"))], force=False)
>>> sorted(x.name for x in d.iterdir()), (out / "a.txt").read_text()
(['result'], 'hi')
"""


from .atomic import atomic_write, atomic_write_bytes, atomic_write_text
from .base import (
    MARKER,
    STAGING_PREFIX,
    TMP_PREFIX,
    Target,
    deferred_interrupts,
    error_number,
    file_mode,
    folder_mode,
    is_write_error,
    terminate_as_exit,
    umask,
    write_error,
)
from .checks import check_outputs, check_overlap, existing_inputs, stale_staging
from .lock import FolderLock, clear_folder, work_folder
from .publishing import new_staging, normal_permissions, publish, publish_bytes

__all__ = [
    "MARKER",
    "STAGING_PREFIX",
    "TMP_PREFIX",
    "FolderLock",
    "Target",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_outputs",
    "check_overlap",
    "clear_folder",
    "deferred_interrupts",
    "error_number",
    "existing_inputs",
    "file_mode",
    "folder_mode",
    "is_write_error",
    "new_staging",
    "normal_permissions",
    "publish",
    "publish_bytes",
    "stale_staging",
    "terminate_as_exit",
    "umask",
    "work_folder",
    "write_error",
]
