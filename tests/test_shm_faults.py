"""Faults an operator meets on the shared-memory path, with real processes: a worker whose map of the
shared file fails (a memory cap) makes every worker fall back to Gloo together; a worker whose chief dies
during the meeting leaves nothing in /dev/shm."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cases import BATCH_SIZES, TOL, build, make_batches, train_reference
from helpers import free_port

from stratagem import environ
from stratagem.cluster import launch
from stratagem.shm import files as shm_files
from stratagem.shm import sums

pytestmark = pytest.mark.skipif(sums.eligible() is not None, reason="shared-memory sums need Linux on x86-64")

WORKER = str(Path(__file__).parent / "workers" / "mwms_train.py")


def _job_files(pid: int) -> list[str]:
    """The files in /dev/shm that process ``pid`` made (their names carry its pid, see shm.files)."""
    return sorted(name for name in os.listdir(shm_files.DIRECTORY) if f"_{pid}_" in name and "stratagem-" in name)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("capped_rank", [1, 0])
def test_a_worker_that_cannot_map_the_file_takes_every_worker_to_gloo(tmp_path, capped_rank):
    # Before: worker:<capped_rank> died with a raw OSError [Errno 12] from open_mapped, and its peer waited
    # out the timeout (60 s here). Now both fall back to Gloo, say why, and train as one device would.
    out = tmp_path / "result.pt"
    env = {**environ.current(), "MW_OUT": str(out), "MW_MAP_CAP_RANK": str(capped_rank), "MW_TIMEOUT": "60"}
    env.pop("STRATAGEM_SHARED_MEMORY", None)
    lines: list[str] = []
    result = launch(
        [sys.executable, WORKER],
        workers=2,
        env=env,
        sink=lambda line: lines.append(f"[{line.task}] {line.text}"),
        timeout=180,
        grace_period=2,
    )
    log = "\n".join(lines[-40:])
    assert result.exit_code == 0, log
    reason = f"worker:{capped_rank}: cannot map 12.0 MiB of /dev/shm/stratagem-"
    saved = torch.load(out)
    assert "cross-worker sums: gloo - " + reason in saved["explain"], saved["explain"]
    assert "(Cannot allocate memory)" in saved["explain"], saved["explain"]
    for rank in (0, 1):  # every worker took the same path, and says why
        (done,) = [line for line in lines if f"rank {rank} done" in line]
        assert "cross-worker sums: gloo - " + reason in done, done
    reference, ref_opt, shape = build("mlp", "sgd_momentum", torch.float64)
    train_reference(reference, ref_opt, make_batches(shape, torch.float64, sizes=BATCH_SIZES))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(saved["state"][key], value, **TOL[torch.float64])


_CHIEF = """
import sys
from datetime import timedelta
import torch.distributed as dist
from stratagem.shm.sums import connect
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=True, timeout=timedelta(seconds=60))
connect(store, rank=0, world_size=2, task_names=["worker:0", "worker:1"], timeout=60, stall_warning_after=60,
        on_failure=lambda *a: RuntimeError(a), on_stall=lambda *a: None, namespace="chief-killed")
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_chief_killed_before_worker_one_maps_the_file_leaves_nothing_in_dev_shm(monkeypatch):
    # The chief (a real process) makes the 12 MiB file in /dev/shm and serves the store; it is SIGKILLed
    # while worker:1 has not mapped the file yet. worker:1's meeting then fails (the store went with the
    # chief); before, it exited with that error and the file stayed until a later job started on the host.
    port = free_port()
    chief = subprocess.Popen([sys.executable, "-c", _CHIEF, str(port)])
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
        store.set_timeout(timedelta(seconds=5))  # connected: a call to the dead chief's store fails within 5 s
        real_open = shm_files.open_mapped
        seen: list[list[str]] = []

        def open_after_the_chief_is_killed(path, size, head, **kwargs):
            store.wait(["stratagem/shm/chief-killed/mapped/0"], timedelta(seconds=60))  # the chief mapped it
            chief.kill()
            chief.wait()
            seen.append(_job_files(chief.pid))
            return real_open(path, size, head, **kwargs)

        monkeypatch.setattr(shm_files, "open_mapped", open_after_the_chief_is_killed)
        with pytest.raises(Exception):  # noqa: B017, PT011 - whatever torch's store raises for a lost server
            sums.connect(
                store,
                rank=1,
                world_size=2,
                task_names=["worker:0", "worker:1"],
                timeout=10,
                stall_warning_after=10,
                on_failure=lambda *a: RuntimeError(a),
                on_stall=lambda *a: None,
                namespace="chief-killed",
            )
    finally:
        chief.kill()
        chief.wait()
    assert len(seen) == 1 and len(seen[0]) == 1, seen  # the file was there when the chief died
    assert _job_files(chief.pid) == []


def test_a_refused_map_is_a_reason_on_the_parameter_server_path_and_leaves_no_file(tmp_path, monkeypatch):
    # The parameter server's worker maps the file it made (make_file) and the server maps the worker's
    # (Segments.attach): both go through open_mapped, which now answers with the reason instead of raising,
    # so the worker's values go over gRPC.
    from stratagem.shm import parameter_server as ps_shared

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(shm_files.mmap, "mmap", refused)
    why = ps_shared.make_file([(torch.float32, 1024)], directory=str(tmp_path))
    assert isinstance(why, str) and why.startswith(f"cannot map 17 KiB of {tmp_path}/stratagem-"), why
    assert why.endswith("(Cannot allocate memory)"), why
    assert os.listdir(tmp_path) == []
