"""Deterministic failures under a supervisor (docs/deploy.md, "Failure policy").

A ``DataError``, a ``ConfigError`` or a refused plan fails the same way on every restart, so
restarting is waste. With ``TONEARM_FATAL_FILE`` set (the Kubernetes Job sets it to a file on the
pod's own ``/tmp``), a training process that fails with one writes its message there before it
exits (status 2, as always; :func:`record_fatal`); a process started while the file exists —
torchrun restarting its workers after that failure — fails at once with the same message
(:func:`refuse_after_fatal`), so torchrun's ``--max-restarts`` are spent in seconds; and the Job's
script turns torchrun's failure into :data:`FATAL_EXIT` when the file exists, which the Job's
``podFailurePolicy`` marks ``FailJob``. Any other failure (a lost node, NCCL, an out-of-memory
kill) is transient: torchrun restarts, then the pod fails and the Job replaces it within
``backoffLimit``.

Below both of its users: the launcher that records a failure (:mod:`training.launch`) and the Job
renderer that turns it into the pod's exit status (:mod:`training.k8s_job`).
"""

from __future__ import annotations

import os

from index.errors import TonearmError

FATAL_EXIT = 42
"""The exit status of a training pod whose run failed deterministically (module doc)."""
FATAL_FILE_ENV = "TONEARM_FATAL_FILE"


class EarlierFatalError(TonearmError):
    """The failure another process of this launch already met (``TONEARM_FATAL_FILE``)."""


def record_fatal(err: BaseException) -> None:
    """Write a deterministic failure's message to ``TONEARM_FATAL_FILE`` (when set; first one wins)."""
    path = os.environ.get(FATAL_FILE_ENV)
    if not path or os.path.exists(path):
        return
    rank = os.environ.get("RANK", "0")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(f"rank {rank}: {type(err).__name__}: {err}\n")
    os.replace(tmp, path)


def refuse_after_fatal() -> None:
    """Fail at once when another process of this launch already failed deterministically."""
    path = os.environ.get(FATAL_FILE_ENV)
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            first = handle.read().strip()
        raise EarlierFatalError(f"not restarted: this launch already failed deterministically ({first}); "
                                f"fix the cause and start a new one ({FATAL_FILE_ENV}={path})")
