"""The decode step's memory roofline of a checkpoint (MoE or dense), and served hkv-bench results against it.

    python -m tools.bench.moe_roofline --model DIR [--context 576] [--bandwidth-gbs 4200 | --measure]
                                 [--batches 1,32,64] [--results c1=a.json c32=b.json ...] [--json out.json]

The roofline is issue 36's: the bytes a decode step of B sequences must read at least, over the
device's copy bandwidth. Every weight except the routed experts (embeddings and head included),
plus the experts the batch touches (E x (1 - (1 - k/E)^B) of each sparse layer, in expectation
for uniform routing), plus every sequence's K/V of `context` tokens, plus each sequence's fp32
linear-attention state read and written. Parameter counts come from the checkpoint's safetensors
headers, so nothing is loaded. With --results, each hkv-bench JSON (label=path, the label's
digits its concurrency) gets its TPOT and median ITL as a fraction of the roofline at that batch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from hkv.models.loader import find_weight_shards, read_hf_config
from tools.bench.bench_report import served_figures

_EXPERT = re.compile(r"\.experts\.(\d+\.)?(gate_up_proj|down_proj|gate_proj|up_proj)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"moe_roofline: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def weight_bytes(folder: Path, bytes_per_param: int = 2) -> tuple[int, int]:
    """(bytes of every weight but the routed experts, bytes of the routed experts) from the headers."""
    from safetensors import safe_open

    other = experts = 0
    for shard in find_weight_shards(folder):
        with safe_open(str(shard.path), framework="pt") as f:
            for name in shard.tensor_names:
                if name.startswith("mtp."):
                    continue  # the drafter is not part of a plain decode step
                count = math.prod(f.get_slice(name).get_shape()) * bytes_per_param
                if _EXPERT.search(name):
                    experts += count
                else:
                    other += count
    return other, experts


def touched_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a batch of `batch` tokens routes to (uniform, independent routing)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def roofline_bytes(config: dict, other: int, experts: int, batch: int, context: int) -> float:
    """The decode step's least bytes at batch `batch` (bf16 weights and K/V, fp32 states)."""
    text = config.get("text_config") or config
    num_experts, top_k = text.get("num_experts", 0), text.get("num_experts_per_tok", 0)
    types = text["layer_types"]
    full, linear = types.count("full_attention"), types.count("linear_attention")
    kv = batch * context * full * 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    hv, dk, dv = text["linear_num_value_heads"], text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv_dim = 2 * text["linear_num_key_heads"] * dk + hv * dv
    state = linear * (hv * dk * dv + conv_dim * (text["linear_conv_kernel_dim"] - 1)) * 4
    touched = touched_experts(num_experts, top_k, batch) / num_experts * experts if num_experts else 0
    return other + touched + kv + 2 * batch * state


def measure_bandwidth() -> float:
    """GB/s of a large device-to-device copy (read + write), as the benchmarks measure it."""
    from tools.bench.bench_decode import copy_bandwidth

    return copy_bandwidth() / 1e9


def _served(path: Path) -> dict:
    doc = json.loads(path.read_text())
    return {**served_figures(doc), "hkv_over_hf": (doc.get("baseline") or {}).get("hkv_over_hf")}


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m tools.bench.moe_roofline", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="the checkpoint folder (MoE or dense)")
    p.add_argument("--context", type=int, default=576, help="tokens of K/V each sequence reads (default: 576)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="copy bandwidth in GB/s (default: --measure)")
    p.add_argument("--measure", action="store_true", help="measure the copy bandwidth on this machine's GPU")
    p.add_argument("--batches", default="1,32,64", help="batch sizes (default: 1,32,64)")
    p.add_argument("--results", nargs="*", default=[], metavar="LABEL=PATH",
                   help="hkv-bench JSON reports; the digits of LABEL are the concurrency")
    p.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    if args.bandwidth_gbs is None and not args.measure:
        p.error("give --bandwidth-gbs or --measure")
    try:
        config = read_hf_config(args.model)
        other, experts = weight_bytes(args.model)
        batches = [int(b) for b in args.batches.split(",")]
        results = {int(re.sub(r"\D", "", label)): _served(Path(path))
                   for label, _, path in (r.partition("=") for r in args.results)}
    except (OSError, ValueError, KeyError) as exc:
        p.error(str(exc))
    if not experts and (config.get("text_config") or config).get("num_experts"):
        p.error(f"{args.model}: no routed expert weights")
    bandwidth = args.bandwidth_gbs or measure_bandwidth()
    rows = []
    print(f"{args.model}: {other / 1e9:.2f} GB besides the experts, {experts / 1e9:.2f} GB of experts; "
          f"copy bandwidth {bandwidth:.0f} GB/s, context {args.context}")
    for batch in sorted(set(batches) | set(results)):
        roof_ms = roofline_bytes(config, other, experts, batch, args.context) / (bandwidth * 1e9) * 1e3
        entry = {"batch": batch, "roofline_ms": roof_ms, **results.get(batch, {})}
        line = f"B{batch:<4} roofline {roof_ms:7.3f} ms"
        if batch in results:
            entry["of_roofline_tpot"] = roof_ms / entry["tpot_ms"]
            entry["of_roofline_itl"] = roof_ms / entry["itl_median_ms"]
            line += (f"  TPOT {entry['tpot_ms']:8.3f} ms ({100 * entry['of_roofline_tpot']:5.1f}%)  median ITL "
                     f"{entry['itl_median_ms']:8.3f} ms ({100 * entry['of_roofline_itl']:5.1f}%)  "
                     f"{entry['output_tokens_per_s']:9.1f} tok/s")
            if entry.get("hkv_over_hf"):
                line += f"  {entry['hkv_over_hf']:.1f}x HF"
        rows.append(entry)
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gbs": bandwidth, "context": args.context, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
