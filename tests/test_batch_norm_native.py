"""Exact BatchNorm's native meetings (batch_norm_native.py): the same bits as the Python meetings on every kind
of layer and step the Python ones handle, the same errors when a meeting goes wrong, a build that happens only
when asked (`stratagem native build`, never inside `distribute`), and a visible fallback where it is not built.
(test_batch_norm.py's equivalence tests run the native meetings too where the machine has them built, as this
file's first test makes sure.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch_norm import batches, build, mirrored
from torch import nn

import stratagem as sg
from stratagem.strategies.data_parallel.cpu_threads import batch_norm_native

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="needs a C++ compiler to build the extension"
)


@pytest.fixture(scope="module", autouse=True)
def built():
    """`stratagem native build`, as a user runs it (once per machine: later runs find it in torch's cache)."""
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "native", "build"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    batch_norm_native.extension.cache_clear()
    return done.stdout


def test_native_build_builds_the_extension_and_distribute_loads_it(built):
    assert "exact BatchNorm uses it from now on" in built
    module, reason = batch_norm_native.extension()
    assert module is not None, reason
    status = subprocess.run([sys.executable, "-m", "stratagem", "native", "status"], capture_output=True, text=True)
    assert status.stdout.startswith("exact BatchNorm on CPU replica threads: native meetings (")


def test_distribute_never_builds_it_and_says_how_to(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    start = time.monotonic()
    assert batch_norm_native.extension.__wrapped__() == (None, batch_norm_native.NOT_BUILT)
    assert time.monotonic() - start < 5 and not (tmp_path / "cache").exists()  # looked, built nothing
    monkeypatch.setattr(batch_norm_native, "extension", batch_norm_native.extension.__wrapped__)
    model, opt, shape = build("conv")
    strategy = mirrored(2)
    strategy.distribute(model, opt)
    assert "the meetings run in Python, as it is not built on this machine (an opt-in speed-up: `stratagem native " in (
        str(strategy.explain())
    )
    strategy.close()


def python_meetings(monkeypatch):
    monkeypatch.setattr(batch_norm_native, "extension", lambda: (None, "the test runs the Python meetings"))


def layered_model(dtype, affine=True, track=True):
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4, affine=affine, track_running_stats=track),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
        nn.BatchNorm1d(5, affine=affine, track_running_stats=track, momentum=None),
        nn.Linear(5, 3),
    ).to(dtype)


def train(n, dtype, sizes, *, affine=True, track=True, weighted=False):
    """Parameters and buffers of replica 0 after training `n` replicas, and what explain() said."""
    strategy = mirrored(n)
    model = layered_model(dtype, affine, track)
    model, opt = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(k, 2, 6, 6, generator=g, dtype=dtype), torch.randint(0, 3, (k,), generator=g)) for k in sizes]

    def step(x, y):
        if weighted:  # a mean over a made-up count of units, not over examples
            sg.set_loss_weight(2 * x.shape[0] + 1)
            loss = F.cross_entropy(model(x), y, reduction="sum") / (2 * x.shape[0] + 1)
        else:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for x, y in strategy.distribute_dataset(data):
        strategy.run(step, args=(x, y))
    state = {k: v.clone() for k, v in model.replicas[0].state_dict().items()}
    text = str(strategy.explain())
    strategy.close()
    return state, text


@pytest.mark.parametrize(
    "n,dtype,affine,track,weighted",
    [
        (2, torch.float32, True, True, False),
        (2, torch.float64, True, True, True),
        (3, torch.float32, False, True, False),
        (3, torch.float64, True, False, True),
    ],
)
def test_the_native_meetings_give_the_python_meetings_bits(monkeypatch, n, dtype, affine, track, weighted):
    # Uneven slices and a global batch of 2 over 3 replicas (a replica on an empty slice's stand-in).
    sizes = [9, 7, 2]
    native, text = train(n, dtype, sizes, affine=affine, track=track, weighted=weighted)
    assert "the meetings run in C++" in text
    python_meetings(monkeypatch)
    python, text = train(n, dtype, sizes, affine=affine, track=track, weighted=weighted)
    assert "the meetings run in Python, as the test runs the Python meetings" in text
    assert list(native) == list(python)
    for key, value in python.items():
        assert torch.equal(native[key], value), key


def two_replicas(timeout):
    """Mirrored x2 on the MLP with BatchNorm, distributed, and one global batch of 6 cut for it."""
    model, opt, shape = build("mlp")
    strategy = mirrored(2, timeout=timeout)
    model, opt = strategy.distribute(model, opt)
    ((x, y),) = strategy.distribute_dataset(batches(shape, sizes=[6]))
    return strategy, model, x, y


def test_a_replica_that_fails_in_forward_is_reported_not_the_one_waiting_for_it():
    strategy, model, x, y = two_replicas(timeout=30)

    def step(x, y):
        if sg.current_replica_context().replica_id_in_sync_group == 1:
            raise KeyError("replica one's own failure")
        F.cross_entropy(model(x), y).backward()

    start = time.monotonic()
    with pytest.raises(KeyError, match="replica one's own failure"):
        strategy.run(step, args=(x, y))
    assert time.monotonic() - start < 10  # replica 0 left its meeting long before the timeout
    strategy.close()


def test_a_replica_at_another_meeting_of_the_step_is_named_at_once():
    # Replica 1 skips the model and waits at the end of backward's gradient meeting (a Python meeting) while replica
    # 0 waits at the first BatchNorm layer's (a native one): the error names both, well before the timeout.
    strategy, model, x, y = two_replicas(timeout=60)
    extra = nn.Linear(6, 1).double()
    other, _ = strategy.distribute(extra, torch.optim.SGD(extra.parameters(), lr=0.1))

    def step(x, y):
        if sg.current_replica_context().replica_id_in_sync_group == 0:
            loss = F.cross_entropy(model(x), y)
        else:
            loss = other(x).sum()
        loss.backward()

    start = time.monotonic()
    with pytest.raises(sg.ReplicaError, match=r"wait\(s\) at the"):
        strategy.run(step, args=(x, y))
    assert time.monotonic() - start < 10
    strategy.close()


def test_explain_says_why_the_meetings_run_in_python(monkeypatch):
    monkeypatch.setattr(batch_norm_native, "extension", lambda: (None, "its build failed (OSError: no compiler)"))
    model, opt, shape = build("conv")
    strategy = mirrored(2)
    strategy.distribute(model, opt)
    assert "the meetings run in Python, as its build failed (OSError: no compiler)" in str(strategy.explain())
    strategy.close()


def _ninja_on_path(monkeypatch):
    import ninja

    monkeypatch.setenv("PATH", os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")]))


def test_a_build_that_fails_raises_and_leaves_the_python_meetings(monkeypatch, tmp_path):
    broken = tmp_path / "batch_norm_native.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(batch_norm_native, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    _ninja_on_path(monkeypatch)
    with pytest.raises(Exception, match="(?i)error"):
        batch_norm_native.build()
    assert batch_norm_native.extension.__wrapped__() == (None, batch_norm_native.NOT_BUILT)


def test_a_build_without_ninja_on_path_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(sg.InputError, match=r"needs ninja on PATH.*pip install 'stratagem\[native\]'"):
        batch_norm_native.build()


def test_a_lock_file_a_stopped_build_left_is_named_not_waited_on(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    _ninja_on_path(monkeypatch)
    where = batch_norm_native.location()
    where.directory.mkdir(parents=True)
    (where.directory / "lock").touch()
    with pytest.raises(sg.InputError, match=r"left torch's lock file .*/lock.* Delete it and run"):
        batch_norm_native.build()
    assert (where.directory / "lock").exists()  # not ours to delete


def test_the_switch_turns_the_native_meetings_off(monkeypatch):
    monkeypatch.setenv(batch_norm_native.SWITCH, "0")
    assert batch_norm_native.extension.__wrapped__() == (None, "STRATAGEM_NATIVE_BATCH_NORM=0 is set")


def test_a_build_waits_for_another_process_building_and_gives_up_at_its_limit(monkeypatch, tmp_path):
    lock = tmp_path / "stratagem.lock"
    monkeypatch.setattr(batch_norm_native, "BUILD_WAIT", 0.5)
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with batch_norm_native._exclusive(lock):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    with pytest.raises(TimeoutError, match=r"held .*stratagem\.lock for more than 0\.5 s"):
        with batch_norm_native._exclusive(lock):
            pass
    release.set()
    thread.join(10)
    with batch_norm_native._exclusive(lock):  # free again
        pass


def test_layers_it_cannot_take_go_to_the_python_meetings():
    bn = nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2)
    assert batch_norm_native.takes(bn, x)
    assert not batch_norm_native.takes(bn, x.to(torch.bfloat16))
    assert not batch_norm_native.takes(bn.double(), x)  # parameters of another dtype (autocast)
    assert not batch_norm_native.takes(nn.BatchNorm2d(3), torch.randn(4, 3, 2, 2).to_sparse())


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 19),
    st.sampled_from([(), (1,), (7,), (3, 5), (2, 2, 3)]),
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(0, 2**16),
)
def test_the_one_pass_input_gradient_has_the_two_passes_bits(batch, channels, spatial, dtype, seed):
    module = batch_norm_native.extension()[0]
    if not module.fused_input_gradient:
        pytest.skip("torch runs no AVX2 or AVX-512 kernels here: the input gradient takes ATen's two passes")
    g = torch.Generator().manual_seed(seed)
    shape = (batch, channels, *spatial)
    x, dy = (torch.randn(shape, generator=g, dtype=dtype) * 3 for _ in range(2))
    mean = torch.randn(channels, generator=g, dtype=dtype)
    var = torch.rand(channels, generator=g, dtype=dtype) * 4
    gain, shift, scale = (torch.randn(channels, generator=g, dtype=dtype) for _ in range(3))
    want = torch.native_batch_norm(x, scale, shift, mean, var, False, 0.0, 1e-5)[0]
    want.addcmul_(dy, gain.view(1, channels, *[1] * len(spatial)))
    got = module.input_gradient(x, dy, mean, var, 1e-5, gain, shift, scale)
    assert torch.equal(got, want), (got - want).abs().max()


def test_replicas_watch_for_the_last_arrival_only_where_each_has_a_core():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert batch_norm_native.spin(1) == batch_norm_native.SPIN > 0
    assert batch_norm_native.spin(cores + 1) == 0.0
