"""Freed host memory kept for reuse: the variables `stratagem launch` gives its tasks, the same through
mallopt for `stratagem train`'s own process, a user's setting left alone, and glibc really honouring it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stratagem.cluster import allocator, task_environments

OURS = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"
HUGE = "glibc.malloc.hugetlb=1"


def test_a_new_process_gets_both_thresholds():
    assert allocator.keep_freed_memory_env({"PATH": "/bin"}, glibc=(2, 36), thp="never") == {"GLIBC_TUNABLES": OURS}


@pytest.mark.parametrize(
    "glibc, thp, env, expected",
    [
        ((2, 36), "madvise", {}, f"{OURS}:{HUGE}"),
        ((2, 35), "madvise", {"MALLOC_TRIM_THRESHOLD_": "0"}, HUGE),  # the user's threshold kept; huge pages added
        ((2, 34), "madvise", {}, OURS),  # no hugetlb tunable before 2.35
        ((2, 36), "always", {}, OURS),  # every block has them already
        ((2, 36), "never", {}, OURS),
        ((2, 36), None, {}, OURS),  # no /sys/kernel/mm/transparent_hugepage
        ((2, 36), "madvise", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, f"glibc.malloc.hugetlb=0:{OURS}"),
        ((2, 36), "madvise", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.top_pad=0"}, None),
    ],
)
def test_huge_pages_are_asked_for_where_the_kernel_gives_them_on_request(glibc, thp, env, expected):
    made = allocator.keep_freed_memory_env(env, glibc=glibc, thp=thp)
    assert made.get("GLIBC_TUNABLES") == expected


def test_the_kernels_huge_page_mode_is_read_from_sysfs(tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert allocator.transparent_huge_pages(mode) == "madvise"
    mode.write_text("[always] madvise never\n")
    assert allocator.transparent_huge_pages(mode) == "always"
    assert allocator.transparent_huge_pages(tmp_path / "absent") is None


def test_other_tunables_of_the_user_are_kept_and_ours_appended():
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX512F"}
    assert allocator.keep_freed_memory_env(env, glibc=(2, 36), thp="never") == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX512F:{OURS}"
    }


@pytest.mark.parametrize(
    "env, named",
    [
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_=0"),
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_=131072"),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=65536"},
            "glibc.malloc.mmap_threshold=65536",
        ),
        ({"GLIBC_TUNABLES": "glibc.malloc.top_pad=0"}, "glibc.malloc.top_pad=0"),
    ],
)
def test_a_threshold_the_user_set_wins(env, named):
    assert allocator.user_setting(env, glibc=(2, 36)) == named
    assert allocator.keep_freed_memory_env(env, glibc=(2, 36), thp="never") == {}
    assert allocator.describe(env, glibc=(2, 36)) == ("as set by the user", named)


def test_other_c_libraries_and_a_glibc_without_tunables_are_left_alone():
    assert allocator.keep_freed_memory_env({}, glibc=None) == {}
    assert allocator.describe({}, glibc=None) == ("the C library's default", "not glibc, so not tuned")
    assert allocator.keep_freed_memory_env({}, glibc=(2, 17)) == {}
    choice, why = allocator.describe({"GLIBC_TUNABLES": OURS}, glibc=(2, 17))
    assert (
        choice == "returned to the system"
        and "glibc 2.17 reads no GLIBC_TUNABLES" in why
        and "MALLOC_TRIM_THRESHOLD_=1073741824" in why
    )
    assert allocator.describe({"MALLOC_TRIM_THRESHOLD_": "1073741824"}, glibc=(2, 17))[0] == "as set by the user"


def test_the_glibc_version_is_read_from_the_c_library():
    version = allocator.glibc_version()
    assert version is None or (version >= (2, 0) and version == allocator.GLIBC)


def test_describe_tells_the_state_and_the_fix(monkeypatch):
    monkeypatch.setattr(allocator, "_applied_here", False)
    assert (
        allocator.describe({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{OURS}"}, glibc=(2, 36))[0] == "kept for reuse"
    )
    choice, why = allocator.describe({}, glibc=(2, 36))
    assert choice == "returned to the system" and f"GLIBC_TUNABLES={OURS}" in why and "stratagem launch" in why
    assert "huge pages" not in allocator.describe({"GLIBC_TUNABLES": OURS}, glibc=(2, 36))[1]
    assert f"huge pages ({HUGE})" in allocator.describe({"GLIBC_TUNABLES": f"{OURS}:{HUGE}"}, glibc=(2, 36))[1]
    assert "huge pages" not in allocator.describe({"GLIBC_TUNABLES": f"{OURS}:{HUGE}"}, glibc=(2, 34))[1]


def test_launched_tasks_keep_freed_memory_unless_told_not_to():
    kept = task_environments({"PATH": "/bin"}, workers=2, ps=1, ports=[1, 2, 3], token="t")
    expected = allocator.keep_freed_memory_env({}).get("GLIBC_TUNABLES")
    assert {env.get("GLIBC_TUNABLES") for env in kept.values()} == {expected}
    assert expected is None or expected.startswith(OURS)
    plain = task_environments({"PATH": "/bin"}, workers=2, ports=[1, 2], token="t", keep_freed_memory=False)
    assert all("GLIBC_TUNABLES" not in env for env in plain.values())
    users = task_environments({"MALLOC_TRIM_THRESHOLD_": "0"}, workers=1, ports=[1], token="t")["worker:0"]
    assert users["MALLOC_TRIM_THRESHOLD_"] == "0" and OURS not in users.get("GLIBC_TUNABLES", "")


# Three 12 MiB blocks allocated, written and freed 20 times. With glibc's defaults the mmap threshold
# slides up to 12 MiB and the trim threshold to twice that, so the 36 MiB freed at the top of the heap go
# back to the system every round (about 9,000 page faults); kept for reuse, they fault in once.
_CHURN = """
import resource, sys
from stratagem.cluster import allocator
if sys.argv[1] == "mallopt":
    assert allocator.keep_freed_memory_here({})
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def churn():
    a = bytearray(12 << 20); b = bytearray(12 << 20); c = bytearray(12 << 20)
for i in range(3):
    churn()
before = faults()
for i in range(20):
    churn()
print((faults() - before) / 20)
"""


@pytest.mark.skipif(not allocator.READS_TUNABLES, reason="needs glibc 2.26 or newer, whose malloc reads GLIBC_TUNABLES")
@pytest.mark.timeout(60)
def test_glibc_honours_the_settings():
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}

    def faults_per_round(mode: str, extra: dict[str, str]) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _CHURN, mode],
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return float(out.stdout)

    default = faults_per_round("default", {})
    launched = faults_per_round("env", allocator.keep_freed_memory_env(base))
    in_process = faults_per_round("mallopt", {})
    assert default > 1000, f"glibc's defaults faulted only {default} pages a round; the test's premise fails"
    assert launched < 50 and in_process < 50, (default, launched, in_process)
    if allocator.huge_pages_env(base):
        # Huge pages alone (glibc's thresholds as they are): the 36 MiB still go back every round, and come in
        # again 2 MiB at a time.
        huge = faults_per_round("env", {"GLIBC_TUNABLES": allocator.HUGE_PAGES})
        assert huge < default / 4, (default, huge)
