"""Start-up progress from the status pipe to the launcher's lines and its `startup` block (hkv/ipc/startup.py,
hkv/launcher.py)."""

from __future__ import annotations

import asyncio
import json
import os
import types

import msgspec
import pytest

from hkv import launcher
from hkv.ipc import json_block, startup
from hkv.ipc.startup import StartupBlock, StartupProgress


def test_the_block_keeps_the_latest_report_and_reads_nothing_it_cannot_trust():
    payload = memoryview(bytearray(startup.NBYTES))
    assert startup.read(payload) is None  # before the first report
    block = StartupBlock(StartupProgress("loading weights", 3, 46, "tensors", 0.5, actor="rank0"), began_at=12.5)
    startup.write(payload, block)
    assert startup.read(payload) == block
    json_block.write(payload, {"progress": {"phase": 7}, "began_at": 1.0})  # not a report
    assert startup.read(payload) is None


@pytest.fixture
def instance():
    inst = launcher.Instance(types.SimpleNamespace(server=types.SimpleNamespace(mode="normal")))
    inst.startup_block = memoryview(bytearray(startup.NBYTES))
    yield inst
    os.close(inst.lifeline_r)
    os.close(inst.lifeline_w)


def _line(report: StartupProgress) -> bytes:
    return json.dumps({"progress": msgspec.to_builtins(report)}).encode() + b"\n"


def test_the_launcher_prints_each_report_once_whole_lines_only_and_keeps_the_latest(instance, capsys):
    status_r, status_w = os.pipe()
    child = launcher.Child("rank0", None, status_r)
    begun = _line(StartupProgress("capturing decode graphs", 0, 24, "graphs"))
    advanced = _line(StartupProgress("capturing decode graphs", 6, 24, "graphs", 3.0, actor="router"))
    try:
        os.write(status_w, begun + advanced[:20])  # a line cut in two reads
        instance._on_status(child)
        os.write(status_w, advanced[20:] + b'{"progress": {"phase": 1}}\n{"ready": {"rank": 0}}\n')
        instance._on_status(child)
    finally:
        os.close(status_r)
        os.close(status_w)
    assert capsys.readouterr().err.splitlines() == [
        "hkv-launch: rank0: capturing decode graphs (0/24 graphs)",
        "hkv-launch: rank0: capturing decode graphs (6/24 graphs, 3.0 s)",  # the launcher names the actor
    ]
    assert child.ready.is_set()
    block = startup.read(instance.startup_block)
    assert block.progress.done == 6 and block.progress.actor == "rank0"


async def test_a_silent_phase_is_printed_again_with_its_time_so_far(instance, capsys, monkeypatch):
    monkeypatch.setattr(launcher, "TICK_S", 0.05)
    progress = StartupProgress("compiling prefill kernels", 1, 3, "steps", 2.0, actor="rank0")
    instance.phase = StartupBlock(progress, began_at=instance.printed_at - 2.0)
    ticker = asyncio.ensure_future(instance.tick())
    await asyncio.sleep(0.13)
    lines = capsys.readouterr().err.splitlines()
    assert 1 <= len(lines) <= 3 and all(
        line.startswith("hkv-launch: rank0: compiling prefill kernels (1/3 steps, 2.") for line in lines), lines
    instance.phase = StartupBlock(msgspec.structs.replace(progress, ended=True), began_at=0.0)
    await asyncio.sleep(0.13)  # between phases: nothing to repeat
    ticker.cancel()
    assert capsys.readouterr().err == ""
