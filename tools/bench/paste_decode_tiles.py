"""Paste the FP8 KV decode sweep's pick into DECODE_TILES (hkv_kernels/paged_attention/triton_paged_attention.py).

`bash tools/gpu/gpu_fp8kv.sh sweep,decode` runs the sweep (tools/bench/bench_decode_fp8kv.py), then this on the
device's copy of the source, so that the decode step of the same call runs the picked FP8 tiles; the line it pastes
is printed, for the developer to paste into the repository once the numbers hold.

    python -m tools.bench.paste_decode_tiles SWEEP_LOG [--source PATH] [--pages fp8_e4m3|bfloat16|...]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hkv_kernels.paged_attention import triton_paged_attention

HEADER = "DECODE_TILES line for {pages} pages"
# a table entry as bench_decode_fp8kv.table_entry prints it: `    True: (DecodeTile(...), DecodeTile(...)),`
ENTRY = re.compile(r"^    (True|False): \(DecodeTile\([^()]*\), DecodeTile\([^()]*\)\),$")


class PasteError(ValueError):
    """The log has no pick for the pages, or the source has no entry to replace."""


def picked_line(log: str, pages: str = "fp8_e4m3") -> str:
    """The table line printed under the sweep's header for `pages` (the last one, should the log hold two runs)."""
    lines = log.splitlines()
    found = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith(HEADER.format(pages=pages))]
    if not found or not ENTRY.match(found[-1]):
        raise PasteError(f"no DECODE_TILES line for {pages} pages in the sweep's log")
    return found[-1]


def paste(source: str, line: str) -> str:
    """`source` with the DECODE_TILES entry of line's page dtype (True or False) replaced by `line`."""
    key = ENTRY.match(line)
    if key is None:
        raise PasteError(f"not a DECODE_TILES entry: {line!r}")
    lines = source.splitlines(keepends=True)
    at = [i for i, old in enumerate(lines) if ENTRY.match(old.rstrip("\n")) and old.startswith(f"    {key[1]}: ")]
    if len(at) != 1:
        raise PasteError(f"{len(at)} DECODE_TILES entries for {key[1]} in the source, not one")
    lines[at[0]] = line + "\n"
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the sweep's output (bench_kernels --only decode_fp8kv)")
    parser.add_argument("--source", type=Path, default=Path(triton_paged_attention.__file__),
                        help="the file holding DECODE_TILES (default: the installed kernel module)")
    parser.add_argument("--pages", default="fp8_e4m3", help="whose pick to paste, as the sweep names pages")
    args = parser.parse_args(argv)
    try:
        line = picked_line(args.log.read_text(), args.pages)
        args.source.write_text(paste(args.source.read_text(), line))
    except (OSError, PasteError) as exc:
        print(f"paste_decode_tiles: {exc}; DECODE_TILES left as it was", file=sys.stderr)
        return 1
    print(f"pasted into {args.source}:\n{line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
