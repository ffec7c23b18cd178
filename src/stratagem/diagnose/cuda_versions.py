"""Which NVIDIA driver each CUDA release needs, and version strings as numbers to compare."""

from __future__ import annotations

import re

# Minimum driver release for each CUDA major version under minor-version compatibility, from
# NVIDIA's CUDA Toolkit Release Notes ("CUDA Toolkit and Minimum Required Driver Version for CUDA
# Minor Version Compatibility", Linux x86_64 column); 13.x lists ">= 580", first shipped as 580.65.06.
MIN_DRIVER_FOR_CUDA_MAJOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def version_numbers(text: str | None) -> tuple[int, ...]:
    """The numbers of a version string, to compare: ``"525.60.13"`` -> ``(525, 60, 13)``."""
    return tuple(int(part) for part in re.findall(r"\d+", text or ""))


def major_version(version: str | None) -> int:
    """The first number of a version string, 0 when there is none: ``"12.4"`` -> 12."""
    return version_numbers(version)[0] if version else 0
