"""The first code a worker process runs: the engine's environment, then the worker itself.

Workers are forked from multiprocessing's fork server, which imported torch once when the first
engine started (:func:`swiftspec.engine.processes.start_context`). A forked worker inherits the
fork server's environment, not the engine's, so :func:`run` puts the engine's in place before the
worker starts. SwiftSpec reads its variables when they are first needed, never at import (the
worker's modules are imported while its arguments are unpickled, before :func:`run`); libraries
that read theirs at import (torch's OpenMP runtime: ``OMP_*``) see the environment the fork
server started with, that of the first engine of the process.
"""
from __future__ import annotations

import atexit
import os


def run(environ: dict[str, str], entry, *args) -> None:
    """Process target of every worker the engine starts (:func:`swiftspec.engine.processes.new_process`).

    Args:
        environ: the engine process's ``os.environ`` when it started the worker; it replaces the
            worker's own before anything else runs.
        entry: the worker's entry point (:func:`swiftspec.engine.worker.worker_main` or
            :func:`swiftspec.pipeline.worker.stage_main`: ``args`` are its
            :class:`~swiftspec.engine.worker.WorkerSpec` and pipes), called as ``entry(*args)``.

    A forked child leaves through ``os._exit``, so the ``atexit`` handlers the worker registered
    (e.g. removing a shared-memory segment it created) are run here, as a spawned child's
    interpreter would at exit.
    """
    os.environ.clear()
    os.environ.update(environ)
    try:
        entry(*args)
    finally:
        atexit._run_exitfuncs()
