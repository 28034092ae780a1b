"""`hkv-inspect` --list / --sweep / --name, run as `python -m tools.inspect`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hkv.ipc.shm import SHM_DIR, Registry, ShmRegion
from tools.inspect import InstanceNotFound, inspect_instance, main

from tests.shm_helpers import REPO, fresh_instance, make_dead_segment


@pytest.fixture
def instance():
    """A fresh instance name per test; every segment under it is unlinked after."""
    yield from fresh_instance("i")


def inspect_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.inspect", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=30)


def test_list_marks_live_and_orphan_segments(instance):
    make_dead_segment(instance, "dead")
    with ShmRegion.create(instance, "live", 64, "router"):
        listed = inspect_cli("--list", "--json")
        assert listed.returncode == 0, listed.stderr
        mine = {s["region"]: s for s in json.loads(listed.stdout) if s["instance"] == instance}
        assert mine["live"]["state"] == "alive" and mine["live"]["creator_pid"] == os.getpid()
        assert mine["dead"]["state"] == "orphan" and mine["dead"]["alive"] is False
        assert mine["live"]["size"] == 128 + 64

        text = inspect_cli("--list", "--name", instance)
        lines = [line.split() for line in text.stdout.splitlines()[1:]]
        assert text.returncode == 0
        assert [(w[0], w[1], w[4]) for w in lines] == [
            (instance, "dead", "orphan"), (instance, "live", "alive")]


def test_sweep_removes_only_orphans(instance):
    make_dead_segment(instance, "dead")
    with ShmRegion.create(instance, "live", 64, "router"):
        # --name keeps the sweep to this test's instance; other sessions share /dev/shm.
        swept = inspect_cli("--sweep", "--name", instance)
        assert swept.returncode == 0, swept.stderr
        assert swept.stdout.splitlines() == [f"removed /hkv-{instance}-dead"]
        again = inspect_cli("--sweep", "--name", instance, "--json")
        assert json.loads(again.stdout) == {"removed": []}
        assert os.path.exists(f"{SHM_DIR}/hkv-{instance}-live")
        assert not os.path.exists(f"{SHM_DIR}/hkv-{instance}-dead")


def test_name_reads_the_registry(instance, capsys):
    with Registry.create(instance, capacity=4) as registry:
        registry.add("req_table", "router", 1, {"slots": 8})
        report = inspect_instance(instance)
        assert report == {"instance": instance, "regions": [{
            "region": "req_table", "segment": f"/hkv-{instance}-req_table", "writer": "router",
            "version": 1, "layout": {"slots": 8}, "creator_pid": os.getpid()}]}
        assert main(["--name", instance, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == report
        proc = inspect_cli("--name", instance)
        assert proc.returncode == 0 and "req_table" in proc.stdout


def test_a_stats_block_of_another_layout_version_exits_1_with_one_line(instance):
    """Its float fields would read as plausible, wrong numbers: refused, naming both versions."""
    from hkv.ipc import stats
    from hkv.ipc.shm import LayoutMismatch

    with Registry.create(instance, capacity=4) as registry:
        registry.add(stats.REGION, "router", stats.VERSION + 1, {"fields": ["steps"]})
        with pytest.raises(LayoutMismatch, match=f"version {stats.VERSION + 1}.*reads version {stats.VERSION}"):
            inspect_instance(instance)
        proc = inspect_cli("--name", instance, "--json")
        assert proc.returncode == 1 and proc.stdout == ""
        assert len(proc.stderr.strip().splitlines()) == 1 and stats.REGION in proc.stderr


def test_unknown_instance_exits_1_with_one_line(instance):
    with pytest.raises(InstanceNotFound):
        inspect_instance(instance)
    proc = inspect_cli("--name", instance)
    assert proc.returncode == 1
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert instance in proc.stderr


@pytest.mark.parametrize("argv", [[], ["--list", "--sweep"], ["--name", "bad-name"],
                                  ["--bogus"]])
def test_bad_usage_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    capsys.readouterr()


def test_a_prefill_or_decode_instance_shows_its_transporter_block(instance, capsys):
    from hkv.ipc import json_block
    from hkv.ipc.tier_regions import PD_STATS_NBYTES, PD_STATS_REGION

    doc = {"address": "tcp://127.0.0.1:5555", "mode": "decode", "frames": {"accepted": 7, "replay": 1},
           "runs_held": 0, "links": 1, "fetches_ok": 3, "pages_received": 40}
    with Registry.create(instance, capacity=4) as registry, \
            ShmRegion.create(instance, PD_STATS_REGION, PD_STATS_NBYTES, "transporter") as region:
        registry.add(PD_STATS_REGION, "transporter", 1, {"format": "json_block"})
        json_block.write(region.payload, doc)
        assert inspect_instance(instance)["pd"] == doc
        assert main(["--name", instance]) == 0
        out = capsys.readouterr().out
        assert "pd            mode=decode address=tcp://127.0.0.1:5555 runs_held=0 links=1 frames accepted=7 replay=1" in out
        assert "fetches_ok=3 pages_received=40" in out


def test_steps_show_how_many_replayed_graphs_by_kind(instance, capsys):
    from hkv.ipc import stats

    with Registry.create(instance, capacity=4) as registry, \
            ShmRegion.create(instance, stats.REGION, stats.NBYTES, "router") as region:
        registry.add(stats.REGION, "router", stats.VERSION, {"fields": list(stats.FIELDS)})
        block = stats.RouterStats(region.payload)
        block.add_many({"steps": 12, "graph_steps_decode": 9, "graph_steps_short_prefill": 2, "graph_steps_mixed": 1})
        block.release_views()
        steps = inspect_instance(instance)["steps"]
        assert steps["steps"] == 12
        assert steps["graph_steps"] == {"decode": 9, "short_prefill": 2, "verify": 0, "mixed": 1}
        assert main(["--name", instance]) == 0
        assert "graph_steps decode=9 short_prefill=2 verify=0 mixed=1" in capsys.readouterr().out
