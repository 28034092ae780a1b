"""Issue 41's tables: one model served at several `--tp N`, from the files tools/gpu/gpu_tp_speed.sh leaves in DIR.

    python -m tools.bench.tp_report --model-name bench --dir .out [--tps 1,2,4] [--out .out/tp_speed_bench.md]

Served: hkv-bench's JSON `DIR/tp_<model>_tp<N>_c<c>.json` per tp and concurrency gives TPOT (mean), the median
inter-token latency and output tokens/s; each is set against `--tp 1` at the same concurrency (output tokens/s as
tp N's over tp 1's, the median ITL as tp 1's over tp N's: above 1 is faster either way). Profiled: every rank's
`DIR/prof_<model>_tp<N>/profile_rank<r>_rows<n>.json` (hkv/engine/step_profile.py, written on a server started
after the timed ones) gives a decode step of n rows: wall and busy ms, the collectives' (all-reduces, the logits'
all-gather) part of the busy time on rank 0 and its largest over the ranks, and rank 0's top kernels. Parity: the
pytest summary at the end of `DIR/tp_parity_<model>.log`. A file that is missing reads "not run", one that is
not what its writer writes "unreadable" (the others still show).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tools.bench.bench_report import served_figures

NOT_RUN = "not run"
TOP_KERNELS = 3
KERNEL_CHARS = 60  # CUTLASS and Triton names run to hundreds of characters
_PYTEST_SUMMARY = re.compile(r"^=+ .*\b(passed|failed|skipped|error|errors|deselected)\b.* in [\d.]+s.* =+$")


def served_path(folder: Path, model: str, tp: int, concurrency: int) -> Path:
    return folder / f"tp_{model}_tp{tp}_c{concurrency}.json"


def profile_folder(folder: Path, model: str, tp: int) -> Path:
    return folder / f"prof_{model}_tp{tp}"


class Unreadable(Exception):
    """A file is there but is not what its writer writes (cut short by a timeout, another format)."""


def _json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Unreadable(f"{path.name}: {exc}") from None
    if not isinstance(doc, dict):
        raise Unreadable(f"{path.name}: a JSON {type(doc).__name__}, not an object")
    return doc


def read_served(path: Path) -> dict | None:
    """TPOT mean, median ITL (ms), output tokens/s and the failed requests of one hkv-bench JSON; None if absent,
    Unreadable if it is not hkv-bench's."""
    if not path.is_file():
        return None
    doc = _json(path)
    try:
        figures, requests = served_figures(doc), doc["requests"]
        return {**figures, "sent": requests["sent"], "failed": requests["failed"],
                "first_error": requests["first_error"]}
    except (KeyError, TypeError) as exc:
        raise Unreadable(f"{path.name}: no {exc} (not an hkv-bench report)") from None


def read_profiles(folder: Path, rows: int) -> dict[int, dict]:
    """Every rank's step profile of `rows` rows in `folder`, by rank ({} when none was written); Unreadable if one
    is not the step profiler's."""
    reports = {}
    for path in sorted(folder.glob(f"profile_rank*_rows{rows}.json")):
        report = _json(path)
        missing = {"rank", "wall_ms", "busy_ms", "comm_ms", "comm_share", "top"} - set(report)
        if missing:
            raise Unreadable(f"{path.name}: no {', '.join(sorted(missing))} (not a step profile)")
        reports[report["rank"]] = report
    return reports


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return "-" if not numerator or not denominator else f"{numerator / denominator:.2f}x"


def _kernel(name: str, ms: float) -> str:
    short = name if len(name) <= KERNEL_CHARS else name[:KERNEL_CHARS] + "..."
    return f"`{short.replace('|', '/').replace('`', '')}` {ms:.3f}"


def _served_or_none(path: Path) -> dict | None:
    """The baseline's figures, None when absent or unreadable (its own row says which)."""
    try:
        return read_served(path)
    except Unreadable:
        return None


def served_table(folder: Path, model: str, tps: list[int], concurrencies: list[int]) -> list[str]:
    """The served table's lines, then one line per run that had failed requests."""
    lines = ["| concurrency | tp | TPOT mean | median ITL | output tokens/s | tokens/s against tp 1 | "
             "ITL speed-up against tp 1 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    failures = []
    for c in concurrencies:
        base = _served_or_none(served_path(folder, model, 1, c))
        for tp in tps:
            try:
                run = read_served(served_path(folder, model, tp, c))
            except Unreadable as exc:
                lines.append(f"| {c} | {tp} | unreadable: {exc} | | | | |")
                continue
            if run is None:
                lines.append(f"| {c} | {tp} | {NOT_RUN} | | | | |")
                continue
            tokens = run["output_tokens_per_s"]
            lines.append(f"| {c} | {tp} | {_ms(run['tpot_ms'])} | {_ms(run['itl_median_ms'])} | "
                         f"{'-' if tokens is None else f'{tokens:,.1f}'} | "
                         f"{_ratio(tokens, base and base['output_tokens_per_s'])} | "
                         f"{_ratio(base and base['itl_median_ms'], run['itl_median_ms'])} |")
            if run["failed"]:
                failures.append(f"- tp {tp}, c = {c}: {run['failed']} of {run['sent']} requests failed, first: "
                                f"{run['first_error']}")
    return lines + ([""] + failures if failures else [])


def profile_table(folder: Path, model: str, tps: list[int], rows: list[int]) -> list[str]:
    """The profiled steps' lines: one per tp and decode batch size."""
    lines = ["| tp | rows | wall / step | busy / step | collectives / step, rank 0 | collectives of busy, rank 0 | "
             "largest over ranks | rank 0's top kernels (ms / step) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tp in tps:
        for n in rows:
            try:
                reports = read_profiles(profile_folder(folder, model, tp), n)
            except Unreadable as exc:
                lines.append(f"| {tp} | {n} | unreadable: {exc} | | | | | |")
                continue
            first = reports.get(0)
            if first is None:
                lines.append(f"| {tp} | {n} | {NOT_RUN} | | | | | |")
                continue
            largest = f"{100 * max(r['comm_share'] for r in reports.values()):.1f}%"
            if len(reports) < tp:
                largest += f" ({len(reports)} of {tp} ranks)"
            top = "; ".join(_kernel(name, ms) for name, ms in first["top"][:TOP_KERNELS])
            lines.append(f"| {tp} | {n} | {_ms(first['wall_ms'])} | {_ms(first['busy_ms'])} | "
                         f"{_ms(first['comm_ms'])} | {100 * first['comm_share']:.1f}% | {largest} | {top} |")
    return lines


def parity_line(log: Path) -> str:
    """The last pytest summary line of the parity log, or why there is none."""
    if not log.is_file():
        return NOT_RUN
    found = [line.strip("= \n") for line in log.read_text(errors="replace").splitlines()
             if _PYTEST_SUMMARY.match(line.strip())]
    return found[-1] if found else f"no pytest summary in {log.name} (cut short?)"


def report(folder: Path, model: str, tps: list[int], concurrencies: list[int], rows: list[int]) -> str:
    """The model's markdown: served table, profiled steps, parity."""
    lines = [f"## --tp {', '.join(map(str, tps))}: {model}", "",
             f"Served (hkv-bench, `{folder}/tp_{model}_tp<N>_c<c>.json`):", "",
             *served_table(folder, model, tps, concurrencies), "",
             f"Decode steps under the profiler (`{folder}/prof_{model}_tp<N>/`; collectives: NCCL all-reduces and the "
             "logits' all-gather, on a CPU rank gloo):", "",
             *profile_table(folder, model, tps, rows), "",
             f"fp32 greedy parity with transformers through graphs: {parity_line(folder / f'tp_parity_{model}.log')}"]
    return "\n".join(lines) + "\n"


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"tp_report: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m tools.bench.tp_report", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", required=True, help="the model's name in the file names (bench, large)")
    p.add_argument("--dir", type=Path, required=True, help="the folder of the run's files (the device call's $OUT)")
    p.add_argument("--tps", default="1,2,4", help="tensor-parallel sizes to list, tp 1 the baseline (default: 1,2,4)")
    p.add_argument("--concurrencies", default="1,32,64", help="hkv-bench concurrencies to list (default: 1,32,64)")
    p.add_argument("--rows", default="1,32,64", help="profiled decode batch sizes to list (default: 1,32,64)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown here (default: stdout only)")
    args = p.parse_args(argv)
    try:
        sizes = _sizes(args.tps), _sizes(args.concurrencies), _sizes(args.rows)
    except ValueError as exc:
        p.error(f"a list of sizes: {exc}")
    text = report(args.dir, args.model_name, *sizes)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
