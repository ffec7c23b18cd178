"""Whether this process may share memory with the other processes of its host, and if not, why.

One set of checks for both transports (the multi-worker sums and the parameter server's files):

- the switch: ``STRATAGEM_SHARED_MEMORY=0`` (read by ``stratagem.environ``) turns both off, so
  MultiWorkerMirrored sums through Gloo and values travel to and from parameter servers over gRPC;
- the platform: Linux (futex(2), ``/proc``, a tmpfs ``/dev/shm``), and x86-64 wherever a counter in
  shared memory orders the data written before it (``ordered_stores``);
- the directory: it exists and this user may create files in it.

Each answer is None (go ahead) or a reason in words, which ``explain()`` shows as it is.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

from stratagem import environ
from stratagem.errors import InputError
from stratagem.shm.files import DIRECTORY

TURNED_OFF = "turned off (shared_memory=False)"
"""The reason when a strategy's own ``shared_memory=False`` keeps it off."""
OFF = ("0", "false", "off", "no")
ON = ("1", "true", "on", "yes")


def turned_off(env: Mapping[str, str] | None = None) -> str | None:
    """``"turned off by STRATAGEM_SHARED_MEMORY=0"`` when the switch in ``env`` (default: this process's
    environment) turns shared memory off, None when it is unset or on. Raises ``InputError`` for any other value."""
    value = environ.shared_memory_setting(env)
    if value is None or value.lower() in ON:
        return None
    if value.lower() in OFF:
        return f"turned off by {environ.SHARED_MEMORY}={value}"
    raise InputError(
        f"{environ.SHARED_MEMORY} must be 0 (shared memory off) or 1 (on). Received: "
        f"{environ.SHARED_MEMORY}={value!r:.40}. Set it to 0 to send everything through Gloo and "
        "gRPC, or unset it to use shared memory where it works."
    )


def check_wanted(shared_memory: bool | None, env: Mapping[str, str] | None = None) -> None:
    """Checks a strategy's ``shared_memory=`` against the switch before any work starts: the switch wins over the
    default (None falls back quietly), and ``shared_memory=True`` with the switch off is an ``InputError``."""
    off = turned_off(env)
    if shared_memory is True and off is not None:
        setting = off.removeprefix("turned off by ")
        raise InputError(
            f"shared_memory=True asks for shared memory, but {setting} turns it off for this process, "
            f"and the switch wins over every strategy's argument. Received: shared_memory=True, "
            f"{setting}. Unset {environ.SHARED_MEMORY} to use shared memory, or leave shared_memory "
            "unset to follow the switch."
        )


def ordered_stores(what: str = "counters in shared memory") -> str | None:
    """None when processes can order their use of shared memory with counters in it, else why not.

    A counter stored after the data it announces, and read before that data, orders them only where
    the processor keeps stores in order and loads in order (x86-64's total store order); other
    architectures need fences Python cannot issue. Sleeping on a counter needs Linux's futex(2).
    """
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            f"{what} need Linux on x86-64 (ordered stores without explicit fences); this is "
            f"{sys.platform} on {platform.machine()}"
        )
    return None


def why_not(
    what: str, directory: str = DIRECTORY, *, ordered: bool, env: Mapping[str, str] | None = None
) -> str | None:
    """None when this process can share memory through files in ``directory``, else why not. ``what`` names the
    transport in the reason; ``ordered``: it needs counters that order data (``ordered_stores``), not only Linux."""
    why = turned_off(env)
    if why is None:
        if ordered:
            why = ordered_stores(what)
        elif sys.platform != "linux":
            why = f"{what} need Linux; this is {sys.platform}"
    if why is None and not os.path.isdir(directory):
        why = f"{directory} does not exist"
    if why is None and not os.access(directory, os.W_OK | os.X_OK):
        why = f"this user cannot create files in {directory}"
    return why
