"""`hkv-inspect`: look at hkv shared memory on this host.

    hkv-inspect --list [--name NAME] [--json]    every hkv segment, alive or orphan
    hkv-inspect --sweep [--name NAME] [--json]   unlink segments whose creator is dead
    hkv-inspect --name NAME [--json]             read one live instance (read-only)

Exit codes: 0 ok, 1 instance not found (or its registry unreadable), 2 bad usage.
Run it as `hkv-inspect` or `python -m tools.inspect`; running the file directly
would shadow the standard library's `inspect` module.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from hkv.ipc import json_block, request_table, stats
from hkv.ipc.shm import (
    LayoutMismatch,
    Registry,
    RegionMissing,
    SegmentInfo,
    ShmError,
    ShmRegion,
    list_segments,
    sweep_orphans,
    validate_instance,
)
from hkv.ipc.tier_regions import PD_STATS_REGION, PD_STATS_VERSION, TIER_STATS_REGION
from hkv.ipc.tier_regions import VERSION as TIER_VERSION


# the layout version of every region this hkv-inspect decodes (the registry records the writer's)
SPOKEN_VERSIONS = {stats.REGION: stats.VERSION, stats.RADIX_REGION: 1, request_table.REGION: request_table.VERSION,
                   TIER_STATS_REGION: TIER_VERSION, PD_STATS_REGION: PD_STATS_VERSION}


class InstanceNotFound(Exception):
    """No registry segment exists for the named instance."""


def inspect_instance(name: str) -> dict[str, Any]:
    """Read a live instance's shared memory read-only and describe it (DESIGN.md section 6).

    Returns {"instance", "pools", "radix", "tiers", "requests", "steps", "regions"}, and "pd" (the
    transporter's figures) for a prefill or decode instance.
    Raises InstanceNotFound, or ShmError when a region is corrupt or mid-write.
    """
    try:
        registry = Registry.attach(name, readonly=True)
    except RegionMissing:
        raise InstanceNotFound(f"no hkv instance named {name!r} on this host") from None
    with registry:
        entries = {entry.region: entry for entry in registry.entries()}
    report: dict[str, Any] = {"instance": name, "regions": [asdict(e) for e in entries.values()]}
    _check_versions(name, entries)
    if stats.REGION in entries:
        report.update(_read_stats(name))
    if stats.RADIX_REGION in entries and "radix" in report:
        report["radix"].update(_read_radix(name))
    if "tiers" in entries and "pools" in report:
        _read_tiers(name, report)
    if request_table.REGION in entries:
        report["requests"] = _read_requests(name)
    pair = report.pop("pair", None)  # the router's figures of the pair-group path, shown with the pd ones
    if PD_STATS_REGION in entries:
        report["pd"] = _read_pd(name)
        if pair is not None:
            report["pd"]["pair"] = pair
    return report


def _check_versions(name: str, entries: dict) -> None:
    """LayoutMismatch when the instance was written by an hkv whose layout this one does not read: a
    float block read with another field list would report plausible, wrong numbers."""
    for region, version in SPOKEN_VERSIONS.items():
        entry = entries.get(region)
        if entry is not None and entry.version != version:
            raise LayoutMismatch(f"instance {name!r}: region {region!r} has layout version {entry.version}, this "
                                 f"hkv-inspect reads version {version}; use the hkv-inspect of the hkv serving it")


def _read_stats(name: str) -> dict[str, Any]:
    with ShmRegion.attach(name, stats.REGION, readonly=True) as region:
        view = stats.RouterStats(region.payload)
        values = view.read()
        view.release_views()
    pools = {}
    for key, prefix in (("gpu_pages", "pages"), ("state_slots", "state_slots"), ("window_slots", "window_slots")):
        total, free, cached = (int(values[f"{prefix}_{f}"]) for f in ("total", "free", "cached"))
        pools[key] = {"total": total, "free": free, "cached": cached, "in_use": total - free - cached}
    # the cache worker's block fills this in when the instance runs a CPU tier
    pools["cpu_pages"] = {"total": 0, "free": 0, "cached": 0, "in_use": 0}
    page_size = int(values["page_size"]) if "page_size" in values else None
    radix = {
        "nodes": int(values["radix_nodes"]),
        "cached_pages": pools["gpu_pages"]["cached"],
        "checkpoints": int(values["radix_checkpoints"]),
        "evictable_pages": int(values["radix_evictable_pages"]),
    }
    if page_size:
        radix["cached_tokens"] = radix["cached_pages"] * page_size
    steps = {k: values[k] for k in ("steps", "step_wall_s", "forward_s", "prefill_tokens", "decode_tokens",
                                    "preemptions", "prefix_waits", "waiting", "running", "flushes")}
    steps["graph_steps"] = {kind: int(values[f"graph_steps_{kind}"]) for kind in stats.GRAPH_KINDS}
    gpu = {"cached_tokens_served": int(values["cached_tokens_gpu"])}
    if page_size:
        reachable = int(values["radix_reachable_pages"]) * page_size
        gpu.update(held_tokens=radix["cached_tokens"], reachable_tokens=reachable)
    tiers = {"gpu": gpu,
             "cpu": {"enabled": False, "cached_tokens_served": int(values["cached_tokens_cpu"])},
             "disk": {"enabled": False, "cached_tokens_served": int(values["cached_tokens_disk"])},
             "peer": {"cached_tokens_served": int(values["cached_tokens_peer"])}}
    pair = {"transfers_ok": int(values["pd_pair_ok"]), "transfers_failed": int(values["pd_pair_failed"]),
            "pages": int(values["pd_pair_pages"])}
    return {"pools": pools, "radix": radix, "tiers": tiers, "steps": steps, "pair": pair}


def _read_tiers(name: str, report: dict[str, Any]) -> None:
    """Fill in the CPU and disk tiers from the cache worker's stats block."""
    with ShmRegion.attach(name, TIER_STATS_REGION, readonly=True) as region:
        doc = json_block.read(region.payload)
    if not isinstance(doc, dict) or not isinstance(doc.get("cpu"), dict):
        return
    cpu = doc["cpu"]
    report["pools"]["cpu_pages"] = dict(cpu["pages"])
    report["pools"]["cpu_states"] = dict(cpu["states"])
    tiers = report["tiers"]
    tiers["cpu"].update({k: v for k, v in cpu.items() if k not in ("pages", "states")}, enabled=True)
    if isinstance(doc.get("disk"), dict):
        tiers["disk"].update(doc["disk"], enabled=True)


def _read_pd(name: str) -> dict[str, Any]:
    """The transporter's figures (docs/pd.md): address, mode, frames by outcome, runs held, fetches, pages,
    bytes; empty until the transporter wrote its first block."""
    with ShmRegion.attach(name, PD_STATS_REGION, readonly=True) as region:
        doc = json_block.read(region.payload)
    return doc if isinstance(doc, dict) else {}


def _read_radix(name: str) -> dict[str, Any]:
    """The router's listing of checkpoint-carrying nodes (refreshed at most every 0.5 s while busy)."""
    with ShmRegion.attach(name, stats.RADIX_REGION, readonly=True) as region:
        doc = json_block.read(region.payload)
    if not isinstance(doc, dict):
        return {"checkpoint_nodes": []}
    return {"checkpoint_nodes": doc.get("checkpoint_nodes", []), "listed_all": doc.get("listed_all", True)}


def _read_requests(name: str) -> list[dict]:
    region, table = request_table.attach(name, readonly=True)
    with region:
        rows = table.snapshot()
        table.release_views()
    return rows


def _print_segments(segments: list[SegmentInfo], as_json: bool) -> None:
    if as_json:
        print(json.dumps([s.to_json() for s in segments], indent=2))
        return
    if not segments:
        print("no hkv shared memory segments")
        return
    print(f"{'INSTANCE':<32} {'REGION':<20} {'SIZE':>12} {'PID':>8} STATE")
    for s in segments:
        pid = "-" if s.creator_pid is None else str(s.creator_pid)
        state = s.state.value if s.reason is None else f"{s.state.value} ({s.reason})"
        print(f"{s.instance or s.name:<32} {s.region or '-':<20} {s.size:>12} {pid:>8} {state}")


def _print_instance(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"instance {report['instance']}: {len(report['regions'])} regions")
    for region in report["regions"]:
        print(f"  region {region['region']:<20} writer={region['writer']} version={region['version']}")
    for key, pool in report.get("pools", {}).items():
        print(f"  {key:<13} total={pool['total']:<8} free={pool['free']:<8} cached={pool['cached']:<8} "
              f"in_use={pool['in_use']}")
    if "radix" in report:
        radix = dict(report["radix"])
        nodes = radix.pop("checkpoint_nodes", [])
        radix.pop("listed_all", None)
        print("  radix         " + " ".join(f"{k}={v}" for k, v in radix.items()))
        for node in nodes:
            print(f"    checkpoint at {node['tokens']} tokens in state slot {node['slot']}"
                  f"{' (pinned)' if node['pinned'] else ''}")
    if "steps" in report:
        steps = dict(report["steps"])
        graphs = steps.pop("graph_steps", {})
        print("  steps         " + " ".join(f"{k}={v:g}" for k, v in steps.items()) + " graph_steps "
              + " ".join(f"{k}={v}" for k, v in graphs.items()))
    for tier, info in report.get("tiers", {}).items():
        shown = {k: v for k, v in info.items() if not isinstance(v, dict)}
        print(f"  tier {tier:<8} " + " ".join(f"{k}={v}" for k, v in shown.items()))
    if report.get("pd"):
        pd = report["pd"]
        frames = pd.get("frames", {})
        print(f"  pd            mode={pd.get('mode')} address={pd.get('address')} runs_held={pd.get('runs_held')} "
              f"links={pd.get('links')} frames " + " ".join(f"{k}={v}" for k, v in frames.items()))
        counters = {k: v for k, v in pd.items() if k not in ("mode", "address", "runs_held", "links", "frames")}
        print("                " + " ".join(f"{k}={v}" for k, v in counters.items()))
    for row in report.get("requests", []):
        print(f"  slot {row['slot']:<4} req {row['req_id']:<8} {row['phase']:<8} prompt={row['prompt_len']} "
              f"output={row['output_len']} kv={row['kv_len']} cached={row['cached_len']} pages={row['pages']}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hkv-inspect",
                                     description="Inspect hkv shared memory on this host.")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true",
                        help="list hkv segments and mark orphans (filtered by --name)")
    action.add_argument("--sweep", action="store_true",
                        help="unlink segments whose creator is dead (filtered by --name)")
    parser.add_argument("--name", help="instance name")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not (args.list or args.sweep or args.name):
        parser.error("give --list, --sweep or --name NAME")
    if args.name is not None:
        try:
            validate_instance(args.name)
        except ValueError as e:
            parser.error(str(e))
    if args.list:
        _print_segments(list_segments(args.name), args.json)
        return 0
    if args.sweep:
        removed = sweep_orphans(args.name)
        if args.json:
            print(json.dumps({"removed": removed}))
        else:
            print("\n".join(f"removed {n}" for n in removed) or "no orphans")
        return 0
    try:
        report = inspect_instance(args.name)
    except (InstanceNotFound, ShmError) as e:
        print(f"hkv-inspect: {e}", file=sys.stderr)
        return 1
    _print_instance(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
