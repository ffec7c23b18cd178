"""``stratagem native``: the opt-in native speed-ups, built ahead of time.

Exact BatchNorm between CPU replica threads of one process runs its meetings in Python unless its C++ meeting
(strategies/data_parallel/cpu_threads/batch_norm_native.cpp) is built on the machine; `distribute` never builds it.

    $ pip install 'stratagem[native]'      # ninja (and a C++ compiler from the system)
    $ stratagem native build               # once per machine, about 30 s on 2 cores
    $ stratagem native status              # which path exact BatchNorm takes here, and why
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "native",
        help="build or inspect the opt-in native speed-ups (exact BatchNorm's C++ meeting)",
        description="Exact BatchNorm between CPU replica threads runs its meetings in Python unless its C++ meeting "
        "is built on this machine. `build` compiles it once (a C++ compiler and ninja: pip install "
        "'stratagem[native]'); `status` says which path runs and why.",
    )
    parser.add_argument("action", choices=["build", "status"], help="build the extension, or say where it stands")
    return parser


def run(args: argparse.Namespace) -> int:
    from stratagem.errors import InputError
    from stratagem.strategies.data_parallel.cpu_threads import batch_norm_native

    if args.action == "status":
        module, reason = batch_norm_native.extension()
        where = batch_norm_native.location().library
        if module is not None:
            print(f"exact BatchNorm on CPU replica threads: native meetings ({where})")
        else:
            print(f"exact BatchNorm on CPU replica threads: Python meetings, as {reason}")
        return 0
    ninja_dir = _ninja_outside_path()
    if ninja_dir is not None:
        # The `ninja` package is installed but its folder is not on PATH (a venv used without activating it): the
        # build runs in a child process given that PATH; this process's environment is left as it is.
        print(f"stratagem native build: ninja from the ninja package ({ninja_dir})", flush=True)
        env = {**os.environ, "PATH": os.pathsep.join([ninja_dir, os.environ.get("PATH", "")])}
        return subprocess.run([sys.executable, "-m", "stratagem", "native", "build"], env=env).returncode
    start = time.monotonic()
    print("stratagem native build: building exact BatchNorm's C++ meeting (once per machine)...", flush=True)
    try:
        library = batch_norm_native.build()
    except InputError as error:
        print(f"stratagem native build: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # the compiler's own failure, in one line with what to do
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(
            f"stratagem native build: the build failed ({type(error).__name__}: {first[:300]}). It needs a C++ "
            "compiler (apt-get install g++) and ninja (pip install 'stratagem[native]'); exact BatchNorm keeps "
            "its Python meetings meanwhile.",
            file=sys.stderr,
        )
        return 1
    print(f"stratagem native build: {library} ({time.monotonic() - start:.0f} s); exact BatchNorm uses it from now on")
    return 0


def _ninja_outside_path() -> str | None:
    """The `ninja` package's folder where ninja is installed but not on PATH; None otherwise."""
    import shutil

    if shutil.which("ninja") is not None:
        return None
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return None
    return str(ninja.BIN_DIR)
