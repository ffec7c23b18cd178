"""Why CUDA failed to start: the text torch reported, turned into a verdict with its fix.

``torch.cuda.is_available()`` turns a failed start into ``False`` plus a warning, and the first
CUDA call then raises the same text; `stratagem.diagnose.collect_facts` keeps it as
``EnvironmentFacts.cuda_init_error``. The known failures, with the texts torch gives for them:

* a driver too old for torch's CUDA ("The NVIDIA driver on your system is too old");
* error 802, "system not yet initialized": an NVSwitch machine (HGX, DGX) whose Fabric Manager
  is not running;
* error 804, "forward compatibility was attempted on non supported HW": a CUDA
  forward-compatibility libcuda (a container's ``cuda-compat``) loaded on a GPU that does not
  support forward compatibility;
* MIG: GPUs in MIG mode, of which CUDA shows only the MIG devices it is told about.
"""

from __future__ import annotations

import re

from stratagem.diagnose.cuda_versions import MIN_DRIVER_FOR_CUDA_MAJOR, major_version
from stratagem.diagnose.facts import EnvironmentFacts
from stratagem.diagnose.verdict import Check

SHOW_ERROR = 'python -c "import torch; torch.cuda.init()" shows CUDA\'s own error'


def check_cuda_start(facts: EnvironmentFacts) -> Check:
    """A verdict on CUDA's start-up: ok when it started (or was never tried), else the known cause and fix.

    Example:
        >>> facts = EnvironmentFacts(torch_version="2.4.0+cu124", torch_cuda_version="12.4",
        ...                          cuda_init_error="Error 802: system not yet initialized")
        >>> check_cuda_start(facts).fix.startswith("Start the NVIDIA Fabric Manager")
        True
    """
    error = facts.cuda_init_error
    if error is None:
        started = "CUDA started" if facts.torch_device_count else "CUDA reported no start-up error"
        return Check(
            name="cuda_start",
            verdict="ok",
            reason=f"{started}." if facts.is_cuda_build else "Not applicable: torch is a CPU-only build.",
        )
    text = error.strip()
    if not facts.driver_present and re.search(r"no NVIDIA driver", text, re.IGNORECASE):
        # A CUDA build on a machine without the driver: the driver check says so, with its verdict.
        return Check(
            name="cuda_start",
            verdict="ok",
            reason=f"Not applicable: CUDA did not start because no NVIDIA driver is installed ({text!r}).",
        )
    said = f"CUDA failed to start: {text!r}"
    driver = f" {facts.driver_version}" if facts.driver_version else ""
    if re.search(r"\b802\b|system not yet initialized", text, re.IGNORECASE):
        return Check(
            name="cuda_start",
            verdict="problem",
            reason=(
                f"{said}. Error 802 on a machine whose GPUs are joined by NVSwitch (HGX, DGX) means the "
                "NVIDIA Fabric Manager is not running, so CUDA cannot use any GPU."
            ),
            fix=(
                f"Start the NVIDIA Fabric Manager (sudo systemctl enable --now nvidia-fabricmanager); install the "
                f"nvidia-fabricmanager package of exactly the driver's version{driver} if it is missing."
            ),
        )
    if re.search(r"\b804\b|forward compatibility", text, re.IGNORECASE):
        return Check(
            name="cuda_start",
            verdict="problem",
            reason=(
                f"{said}. Error 804 means a CUDA forward-compatibility driver library (cuda-compat, often a "
                "container's /usr/local/cuda/compat) was loaded on a GPU that does not support forward "
                "compatibility (consumer and workstation GPUs)."
            ),
            fix=(
                "Use the host driver's libcuda: remove the compat directory from LD_LIBRARY_PATH (or the cuda-compat "
                "package from the image), or update the host driver to one that supports torch's CUDA "
                f"{facts.torch_cuda_version}."
            ),
        )
    if re.search(r"too old|insufficient driver|\b35\b", text, re.IGNORECASE):
        minimum = MIN_DRIVER_FOR_CUDA_MAJOR.get(major_version(facts.torch_cuda_version))
        to = f" to {minimum} or newer" if minimum else ""
        return Check(
            name="cuda_start",
            verdict="problem",
            reason=f"{said}. The NVIDIA driver{driver} is too old for torch's CUDA {facts.torch_cuda_version}.",
            fix=(
                f"Update the NVIDIA driver{to}, or install a torch build for an older CUDA (pick one at "
                "https://pytorch.org/get-started/locally/)."
            ),
        )
    if re.search(r"\bMIG\b", text):
        return Check(
            name="cuda_start",
            verdict="problem",
            reason=f"{said}. The GPUs are in MIG mode, where CUDA uses only the MIG devices it is given.",
            fix=(
                "Give each process one MIG device: CUDA_VISIBLE_DEVICES=MIG-<uuid> (nvidia-smi -L lists them), "
                "or disable MIG mode (sudo nvidia-smi -mig 0, then reset the GPU)."
            ),
        )
    return Check(
        name="cuda_start",
        verdict="problem",
        reason=f"{said}.",
        fix=(
            f"Read CUDA's error above; {SHOW_ERROR}. Check that this process may open /dev/nvidia* (containers: "
            "docker run --gpus all) and that nvidia-smi works."
        ),
    )
