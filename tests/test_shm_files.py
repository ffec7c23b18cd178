"""The shared-memory files both co-located transports map: made with room reserved, checked when opened."""

import os
import subprocess
import sys

import pytest

from stratagem.shm import files as shm_files

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="needs posix_fallocate (Linux)")


def test_a_file_is_mapped_only_when_it_is_the_one_its_maker_made(tmp_path):
    path, problem = shm_files.create(str(tmp_path), 4096, b"head-n" + b"n" * 16)
    assert problem is None and os.stat(path).st_mode & 0o077 == 0  # this user's only
    mapping, problem = shm_files.open_mapped(path, 4096, b"head-n" + b"m" * 16, maker="rank 0")
    assert mapping is None and "not the file rank 0 made (another nonce)" in problem
    mapping, problem = shm_files.open_mapped(path, 8192, b"head-n" + b"n" * 16)
    assert mapping is None and "size 4096, expected 8192" in problem
    mapping, problem = shm_files.open_mapped(path, 4096, b"head-n" + b"n" * 16)
    assert problem is None and mapping[:6] == b"head-n"
    mapping.close()


def test_a_link_or_a_missing_file_is_refused(tmp_path):
    path, _ = shm_files.create(str(tmp_path), 4096, b"x" * 8)
    link = tmp_path / "link"
    link.symlink_to(path)
    mapping, problem = shm_files.open_mapped(str(link), 4096, b"x" * 8, maker="worker:0")
    assert mapping is None and "cannot open" in problem and "worker:0" in problem
    mapping, problem = shm_files.open_mapped(str(tmp_path / "gone"), 4096, b"x" * 8)
    assert mapping is None and "cannot open" in problem


def test_no_room_leaves_no_file(tmp_path, monkeypatch):
    def no_room(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    path, problem = shm_files.create(str(tmp_path), 1 << 20, b"x")
    assert path is None and f"{tmp_path} has no room for 1.0 MiB (No space left on device)" == problem
    assert os.listdir(tmp_path) == []


_MAKER = """
import sys, time
from stratagem.shm import parameter_server as shared
path, nonce, mapping = shared.make_file([(shared.torch.float32, 4096)], directory=sys.argv[1])
print(path, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_file_whose_maker_was_killed_before_anyone_mapped_it_is_removed_by_the_next_maker(tmp_path):
    # A parameter-server worker killed between making its file and the server's Attach left the file behind.
    maker = subprocess.Popen([sys.executable, "-c", _MAKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        left = maker.stdout.readline().strip()
    finally:
        maker.kill()
        maker.wait()
    assert os.path.exists(left) and os.path.basename(left).startswith("stratagem-ps-")
    mine, _ = shm_files.create(str(tmp_path), 4096, b"x" * 8)  # a live maker's file: kept
    named = os.path.basename(mine)
    tag, pid = named.split("-", 1)[1].split("_")[:2]
    assert int(pid) == os.getpid()
    other_host = tmp_path / f"stratagem-{'0' * 8 if tag != '0' * 8 else '1' * 8}_1_1_abcdefgh"  # another host's
    other_host.write_bytes(b"x")
    reused_pid = tmp_path / f"stratagem-{tag}_{os.getpid()}_1_abcdefgh"  # this pid, but another process's start
    reused_pid.write_bytes(b"x")
    user_file = tmp_path / "stratagem-notes.txt"
    user_file.write_bytes(b"x")
    newer, problem = shm_files.create(str(tmp_path), 4096, b"y" * 8, prefix="stratagem-ps-")
    assert problem is None
    assert sorted(os.listdir(tmp_path)) == sorted([named, os.path.basename(newer), other_host.name, user_file.name])
    assert shm_files.remove_stale(str(tmp_path)) == []
