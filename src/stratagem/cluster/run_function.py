"""The program each task of `sg.launch` runs: ``python -m stratagem.cluster.run_function DIRECTORY``.

It loads the function and arguments `stratagem.cluster.function.launch` left in DIRECTORY, calls
the function and leaves its pickled return value there for the launcher. A function of the main
script is found by running that script as ``__mp_main__`` first (its ``__main__`` guard keeps its
top-level launch from running again), as multiprocessing's spawn does.
"""

from __future__ import annotations

import pickle
import runpy
import sys
import types
from pathlib import Path

from stratagem import environ
from stratagem.cluster.function import PAYLOAD_NAME, result_path
from stratagem.cluster.resolve import resolve_cluster


def main(directory: str) -> int:
    payload = pickle.loads(Path(directory, PAYLOAD_NAME).read_bytes())
    # The caller's path first, so the function's module imports here as it did there.
    for entry in reversed(payload["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if payload["main_file"] is not None:
        namespace = runpy.run_path(payload["main_file"], run_name="__mp_main__")
        main_module = types.ModuleType("__mp_main__")
        main_module.__dict__.update(namespace)
        sys.modules["__main__"] = sys.modules["__mp_main__"] = main_module
    fn, args, kwargs = pickle.loads(payload["call"])
    value = fn(*args, **kwargs)
    cluster = resolve_cluster(None, env=environ.current())
    if cluster.task_type == "worker":
        target = result_path(directory, cluster.task_name)
        partial = target.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(value))
        partial.replace(target)  # the launcher never reads half a file
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
