"""Every file the product reads is bounded: type, size, nesting, time; bad input exits 2.

The loader (training.spec.load_spec) and the record reader (training.files.read_json) are
thrown generated files of every kind: junk bytes, deep nesting, files over the limit,
character devices behind a symlink, FIFOs, directories, sockets. Each must be refused with
the project's error naming the file, within a bounded time and memory, writing nothing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training.spec import MAX_SPEC_BYTES, SpecError, load_spec
from training.files import MAX_DEPTH, MAX_RECORD_BYTES, InputError, read_json

TIME_LIMIT_S = 5.0  # CPU seconds of the loading thread: the load of a busy host does not count against it
HANG_LIMIT_S = 60.0  # wall clock: a blocking open or an endless read never ends (and takes no CPU while it blocks)
MEMORY_LIMIT = 8 * MAX_SPEC_BYTES  # the bytes, their text, the YAML events of at most MAX_SPEC_BYTES


def bounded_call(fn, *args):
    """fn(*args) in a thread: (its exception or None, the thread's CPU seconds, peak bytes
    Python allocated). A call that blocks (a FIFO's open) fails the test instead of hanging
    it. CPU time, not wall time: under a full test run on two cores the same refusal once
    took over 5 s of wall time for 0.5 s of work (tracemalloc on)."""
    outcome: dict = {}

    def run():
        tracemalloc.start()
        start = time.thread_time()
        try:
            fn(*args)
            outcome["error"] = None
        except BaseException as e:  # noqa: BLE001 (the assertion says which)
            outcome["error"] = e
        outcome["seconds"] = time.thread_time() - start
        outcome["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_LIMIT_S)
    assert not thread.is_alive(), f"{fn.__name__}{args} still running after {HANG_LIMIT_S} s"
    return outcome["error"], outcome["seconds"], outcome["peak"]


def listing(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.lstat().st_mtime_ns) for p in folder.rglob("*"))


# What a spec (or a record) path can turn out to be. Each builder makes it at `path`.
def _junk(data: bytes):
    return lambda path: path.write_bytes(data)


def _symlink(target: str):
    return lambda path: path.symlink_to(target)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # the file stays after close; nobody listens
    s.close()


def _oversized(extra: int):
    def make(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(b"campaign: {name: x}\n")
            f.truncate(MAX_SPEC_BYTES + extra)  # sparse: big to stat, cheap to make
    return make


def _deep(depth: int, opener: str, closer: str, prefix: str):
    return lambda path: path.write_text(prefix + opener * depth + closer * depth + "\n")


def _deep_block(depth: int):
    return lambda path: path.write_text("".join(" " * i + f"k{i}:\n" for i in range(depth)) + " " * depth + "v\n")


def _yaml_of(value):
    return lambda path: path.write_text(yaml.safe_dump(value))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)

hostile = st.one_of(
    st.binary(max_size=2048).map(_junk),
    st.text(max_size=512).map(lambda t: _junk(t.encode("utf-8", "surrogatepass"))),
    st.sampled_from(["/dev/zero", "/dev/urandom", "/dev/null", "/dev/full"]).map(_symlink),
    st.just(_fifo), st.just(_directory), st.just(_socket),
    st.integers(1, 1 << 30).map(_oversized),
    st.builds(_deep, st.integers(40, 20000), st.sampled_from(["["]), st.just("]"), st.sampled_from(["a: ", "", "- "])),
    st.builds(_deep, st.integers(40, 20000), st.just("{a: "), st.just("}"), st.just("")),
    st.integers(40, 400).map(_deep_block),
    json_values.map(_yaml_of),
    st.sampled_from(["a: 2020-13-01\n", "a: !!binary '%%%'\n", "a: !!python/object:os.system {}\n",
                     "? [a, b]\n: c\n", "a: &x 1\nb: *x\n", "\ufeff\x00", "a: !!timestamp 2020-02-30\n",
                     "a: !!int 99999999999999999999999999999\nb: !!float 1e99999\n"]).map(
        lambda t: _junk(t.encode("utf-8", "surrogatepass"))),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(make=hostile)
def test_the_spec_loader_refuses_any_file_by_name_in_bounded_time_and_memory(tmp_path_factory, make):
    assert_refused(tmp_path_factory, "params.yaml", make, load_spec, SpecError, MEMORY_LIMIT)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(make=st.one_of(
    st.binary(max_size=1024).filter(lambda b: not _is_json(b)).map(_junk),
    st.sampled_from(["/dev/zero", "/dev/urandom"]).map(_symlink),
    st.just(_fifo), st.just(_directory), st.just(_socket),
    st.integers(MAX_DEPTH + 1, 100000).map(lambda n: _junk(b"[" * n + b"]" * n)),
    st.integers(MAX_DEPTH + 1, 100000).map(lambda n: _junk(b'{"a":' * n + b"1" + b"}" * n)),
))
def test_a_record_that_is_not_a_record_is_refused_by_name(tmp_path_factory, make):
    assert_refused(tmp_path_factory, "record.json", make, read_json, InputError, 4 * MAX_RECORD_BYTES)


def assert_refused(tmp_path_factory, name: str, make, loader, error_type: type, memory: int) -> None:
    """`loader` refuses the file `make` writes with `error_type`, naming it, within the time
    and memory bounds, and writes or consumes nothing."""
    folder = tmp_path_factory.mktemp(name.split(".")[0])
    path = folder / name
    make(path)
    before = listing(folder)
    error, seconds, peak = bounded_call(loader, path)
    assert isinstance(error, error_type), f"{type(error).__name__}: {error}"
    assert str(path) in str(error), str(error)
    assert seconds < TIME_LIMIT_S and peak < memory, (seconds, peak)
    assert listing(folder) == before  # nothing written, nothing consumed


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
        return True
    except ValueError:
        return False


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"label": "[" * 1000 + '\\"{' * 500, "list": [[1, [2]]]}))
    assert read_json(path)["list"] == [[1, [2]]]
    assert read_json(tmp_path / "missing.json") is None


def test_a_file_that_grows_past_the_limit_while_read_is_refused(tmp_path):
    from training.files import read_bounded

    path = tmp_path / "r.json"
    path.write_bytes(b"x" * 100)
    assert read_bounded(path, 100) == b"x" * 100
    with pytest.raises(InputError, match="more than the 99 allowed"):
        read_bounded(path, 99)


@pytest.mark.parametrize("make", [_symlink("/dev/zero"), _fifo, _deep(5000, "[", "]", "a: "), _junk(b"\xff\xfe\x00junk")],
                         ids=["dev-zero", "fifo", "deep", "binary"])
def test_launch_exits_2_naming_the_spec_and_writes_nothing(tmp_path, make):
    from conftest import campaign_cli

    make(tmp_path / "params.yaml")
    before = listing(tmp_path)
    start = time.monotonic()
    result = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "params.yaml" in output and "Traceback" not in output, output
    assert time.monotonic() - start < 120
    assert listing(tmp_path) == before


def test_status_exits_2_when_a_record_is_a_device(tmp_path):
    from conftest import campaign_cli

    (tmp_path / "checkpoints" / "c").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("c\n")
    (tmp_path / "checkpoints" / "c" / "campaign.json").symlink_to("/dev/zero")
    result = campaign_cli("status", cwd=tmp_path)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "campaign.json is a character device" in output, output


def test_a_resize_request_that_is_a_fifo_is_rejected_not_fatal(tmp_path):
    from tasks.resize import pending_request

    control = tmp_path / "control"
    control.mkdir()
    os.mkfifo(control / "request.json")
    error, seconds, _ = bounded_call(pending_request, tmp_path, set())
    assert error is None and seconds < TIME_LIMIT_S
    answer = read_json(control / "request-result.json")
    assert answer["status"] == "rejected" and "is a FIFO" in answer["detail"], answer
    assert not (control / "request.json").exists() and (control / "request.json.rejected").exists()
    assert pending_request(tmp_path, set()) is None  # answered once, not again
