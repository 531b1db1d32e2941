"""libtpu's memory reports read from its log (nnx_sharding.plan._hardware.tpu_log): a
compile's report is the one logged since its mark whose arguments and host bytes are
its own. The reports below are libtpu's, as it logged them for the offloaded Llama 3.1
70B on 32 v6e chips and a 2-layer decoder on 8 v5e chips compiled beside it."""

from __future__ import annotations

import os

import pytest

from nnx_sharding.plan._hardware import tpu_log

GiB, MiB = 2**30, 2**20
BIG = """\
I1129 21:14:50.286893    2690 deepsea_compiler_backend.cc:2171] Total hbm usage >= 28.76G:
    reserved        260.02M 
    program          16.18G 
    arguments        12.32G 

Output size 12.32G; shares 12.32G with arguments.

Total host usage >= 65.00G:
    reserved             0B 
    program          65.00G 
    arguments            0B 

Output size 0B; shares 0B with arguments.

"""  # noqa: W291 - libtpu's trailing spaces
SMALL = """\
I1129 21:17:21.409675    3250 deepsea_compiler_backend.cc:2171] Total hbm usage >= 384.17M:
    reserved        258.00M 
    program          88.66M 
    arguments        37.51M 

Output size 37.51M; shares 37.51M with arguments.

Total host usage >= 14.00M:
    reserved             0B 
    program          14.00M 
    arguments            0B 

Output size 0B; shares 0B with arguments.

"""  # noqa: W291
UNOFFLOADED = SMALL.replace("program          14.00M", "program         unknown size").replace(
    "Total host usage >= 14.00M", "Total host usage >= 0B"
)
OTHER = "I1129 21:14:50.286912    2690 deepsea_compiler_backend.cc:2175] Program sflag ...\n"


@pytest.fixture
def log(monkeypatch, tmp_path):
    """Writes this process's libtpu INFO log in a folder of its own."""
    monkeypatch.setenv("TPU_LOG_DIR", str(tmp_path))
    path = tmp_path / f"tpu_driver.vm.root.log.INFO.20261129-211307.{os.getpid()}"

    def write(text: str) -> None:
        with open(path, "a") as f:
            f.write(text)

    return write


def test_a_compile_gets_the_report_with_its_own_arguments_and_host_bytes(log):
    log(OTHER)
    start = tpu_log.mark()
    log(BIG + OTHER + UNOFFLOADED + SMALL)  # three compiles' reports, and other lines
    big = tpu_log.program_bytes(start, arguments=round(12.32 * GiB), host=65 * GiB)
    small = tpu_log.program_bytes(start, arguments=round(37.51 * MiB) - 4000, host=14 * MiB)
    assert (big, small) == (round(16.18 * GiB), round(88.66 * MiB))


def test_no_report_or_two_alike_give_none(log):
    start = tpu_log.mark()
    log(BIG)
    later = tpu_log.mark()
    assert tpu_log.program_bytes(later, round(12.32 * GiB), 65 * GiB) is None  # before it
    assert tpu_log.program_bytes(start, round(12.33 * GiB), 65 * GiB) is None  # not its own
    log(BIG.replace("16.18G", "17.00G"))  # another compile, same arguments and host bytes
    assert tpu_log.program_bytes(start, round(12.32 * GiB), 65 * GiB) is None


def test_without_a_log_there_is_no_figure(monkeypatch, tmp_path):
    monkeypatch.setenv("TPU_LOG_DIR", str(tmp_path))
    assert tpu_log.mark() == tpu_log.Mark(None, 0)
    assert tpu_log.program_bytes(tpu_log.mark(), 1, 1) is None


def test_programs_that_offload_compile_one_at_a_time(log):
    """Two compiles of offloading programs never overlap (their reports could not be told
    apart); the others run beside them and get no mark."""
    import threading
    import time

    inside, overlapped = [], []

    def compile_one() -> None:
        with tpu_log.compiling(True) as start:
            assert start == tpu_log.mark()
            overlapped.append(bool(inside))
            inside.append(1)
            time.sleep(0.05)
            inside.pop()

    threads = [threading.Thread(target=compile_one) for _ in range(3)]
    for t in threads:
        t.start()
    with tpu_log.compiling(False) as start:
        assert start is None
    for t in threads:
        t.join()
    assert overlapped == [False, False, False]
