"""The shared-memory files both co-located transports map: made with room reserved, checked when opened."""

import os

import pytest

from stratagem.collective import shm_files

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
