"""One check for every timeout stratagem takes: a real number of seconds, finite, positive, at most a day.

Every constructor, function and CLI option that takes a timeout (or a grace period, a delay) calls
`check_seconds` with the argument's name, so that "every wait has a timeout" holds literally: a NaN
would pass a plain ``timeout <= 0`` test and then no wait would ever end; ``inf`` or ``1e30`` would
reach ``threading`` or ``datetime`` and fail at the first wait with a raw ``OverflowError``; a string
would fail with a raw ``TypeError``; ``True`` would silently mean one second.

Example:
    >>> check_seconds("timeout", 30)
    30.0
    >>> check_seconds("timeout", float("nan"))   # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    InputError: timeout must be a finite number of seconds in (0, 86400]. Received: timeout=nan. ...
"""

from __future__ import annotations

import math
import numbers
from datetime import timedelta

from stratagem.errors import InputError

MAX_SECONDS = 86_400.0
"""The ceiling: one day. No wait of one step, rendezvous or call in a training job is meant to last
longer; a larger value is almost always a unit mistake (milliseconds for seconds) or a stand-in for
"forever", which the library does not offer, and values near the float range overflow the deadlines
that ``threading``, ``datetime`` and gRPC compute from them."""


def check_seconds(name: str, value: object, *, allow_zero: bool = False, error: type[InputError] = InputError) -> float:
    """``value`` as float seconds, refused with an `InputError` naming ``name`` unless it is a real number
    (not a bool), finite, above zero (or zero with ``allow_zero``) and at most `MAX_SECONDS`.

    A ``datetime.timedelta`` is taken as its seconds. ``error`` is the subclass of `InputError` the caller
    documents for its bad arguments (``ClusterError`` for a launch's options).
    """
    low = "[0" if allow_zero else "(0"
    what = f"{name} must be a finite number of seconds in {low}, {MAX_SECONDS:g}]"
    fix = (
        f"Pass seconds as an int or float, e.g. {name}=300; a wait cannot be unbounded, and more than a day "
        "(86400 s) is refused as a likely unit mistake."
    )
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what}. Received: {name}={value!r} of type {type(value).__name__}. {fix}")
    else:
        seconds = float(value)
    if math.isnan(seconds) or seconds > MAX_SECONDS or seconds < 0 or (seconds == 0 and not allow_zero):
        raise error(f"{what}. Received: {name}={value!r}. {fix}")
    return seconds


def check_optional_seconds(
    name: str, value: object, *, allow_zero: bool = False, error: type[InputError] = InputError
) -> float | None:
    """`check_seconds`, with ``None`` (no limit where the caller offers one, e.g. ``sg.launch(timeout=None)``)
    passed through."""
    return None if value is None else check_seconds(name, value, allow_zero=allow_zero, error=error)
