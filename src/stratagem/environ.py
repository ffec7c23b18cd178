"""The one place that reads the process environment.

Everything else takes a ``Mapping[str, str]`` as an argument, so tests pass constructed
environments and nothing reads ``os.environ`` behind the caller's back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def current() -> Mapping[str, str]:
    """A snapshot of the process environment."""
    return dict(os.environ)
