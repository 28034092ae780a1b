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

from hkv.ipc.shm import (
    Registry,
    RegionMissing,
    SegmentInfo,
    ShmError,
    list_segments,
    sweep_orphans,
    validate_instance,
)


class InstanceNotFound(Exception):
    """No registry segment exists for the named instance."""


def inspect_instance(name: str) -> dict[str, Any]:
    """Read a live instance's shared memory read-only and describe it.

    Today: the registry's regions. Pools, requests, radix and tiers (DESIGN.md
    section 6) are added here as their regions land. Raises InstanceNotFound,
    or ShmError when the registry is corrupt or mid-write.
    """
    try:
        registry = Registry.attach(name, readonly=True)
    except RegionMissing:
        raise InstanceNotFound(f"no hkv instance named {name!r} on this host") from None
    with registry:
        regions = [asdict(entry) for entry in registry.entries()]
    return {"instance": name, "regions": regions}


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
        print(f"  {region['region']:<20} writer={region['writer']} "
              f"version={region['version']} creator_pid={region['creator_pid']}")


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
