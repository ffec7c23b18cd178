"""The exceptions stratagem raises.

Every message says what is wrong, the value received, and how to fix it. The classes also
derive from the built-in exception a Python user would expect (``ValueError`` for bad input,
``RuntimeError`` for a failure while running, ``TimeoutError`` for a wait that ran out), so
``except ValueError`` keeps working.
"""

from __future__ import annotations


class StratagemError(Exception):
    """Base class of every error stratagem raises on purpose."""


class DeviceError(StratagemError, ValueError):
    """A device name or device list is invalid (unknown, out of range, duplicated, empty)."""


class GpuUnavailableError(StratagemError, RuntimeError):
    """A GPU was demanded and cannot be had; the message carries the diagnosis."""


class InputError(StratagemError, ValueError):
    """A bad argument or malformed input: a value out of range, training data that is not an iterable of
    batches, a call the API does not allow at that point (``distribute`` twice, a step before ``distribute``)."""


class CorruptCheckpointError(InputError):
    """A checkpoint file is damaged: a checksum differs, it is truncated, or torch cannot read it."""


class BackupDirectoryInUseError(InputError):
    """Another live job holds the backup directory (its claim file is locked); the message names that job."""


class CheckpointWriteError(StratagemError, OSError):
    """A checkpoint could not be written (a full disk, a file-size limit, a read-only file system); the message
    names the path and the cause, and the backups already on disk are left as they were."""


class Preempted(StratagemError, SystemExit):
    """`fit` stopped on SIGTERM or SIGINT at a step boundary every worker agreed on, after writing a backup.

    It is a ``SystemExit`` whose ``code`` is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), so a
    script that does not catch it exits with that code and no traceback, as a process ended by the signal would.
    """

    def __init__(self, message: str, code: int, step: int) -> None:
        super().__init__(message)
        self.code = code
        self.step = step
        """The global step the backup holds (the last one applied)."""


class ReplicaError(StratagemError, RuntimeError):
    """A replica failed while running a step; the message names the replica."""


class CollectiveTimeoutError(StratagemError, TimeoutError):
    """A wait for other replicas, ranks or tasks ran out; the message names who was missing."""


class ClusterError(InputError):
    """The cluster description (TF_CONFIG, torchrun or SLURM variables) or a launch's arguments are malformed."""


class RendezvousError(StratagemError, RuntimeError):
    """Processes could not meet: a peer (usually the chief) went away during the rendezvous."""


class MemoryEstimateError(StratagemError, RuntimeError):
    """A device does not have the memory the model needs; the message has both numbers."""


class MemoryEstimateInputError(StratagemError, ValueError):
    """A memory estimate was asked for something it cannot size (unknown optimizer, bad byte count)."""


class DeviceConfigurationError(StratagemError, RuntimeError):
    """Logical devices were reconfigured after a strategy started using them."""


class WireFormatError(StratagemError, ValueError):
    """A parameter-server message is malformed (bad framing, header, dtype, shape or length)."""


class ParameterServerError(StratagemError, RuntimeError):
    """A parameter-server or worker task was lost or refused a call; the message names the task."""


class PlacementError(StratagemError, NotImplementedError):
    """An operation has no kernel on the device its inputs are on; the message names both and the fix.

    It derives from ``NotImplementedError``, which torch raises for the same problem, so code
    that catches torch's error keeps working.
    """


class LaunchError(StratagemError, RuntimeError):
    """A task of a local cluster started by `sg.launch` failed or timed out; `.result` says which and how."""

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result
