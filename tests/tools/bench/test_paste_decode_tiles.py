"""tools/bench/paste_decode_tiles.py: the FP8 KV sweep's printed pick replaces its DECODE_TILES entry in the kernel's
source (what `gpu_fp8kv.sh sweep,decode` does on the device before the decode step), and nothing else."""

import ast
import inspect

import pytest

from hkv_kernels.paged_attention import triton_paged_attention as paged
from hkv_kernels.paged_attention.triton_paged_attention import DECODE_TILES, DecodeTile
from tools.bench import paste_decode_tiles as paste
from tools.bench.bench_decode_fp8kv import table_entry

PICK = table_entry(True, DecodeTile(128, 8, 2, kv_dot=2), DecodeTile(32, 4, 3, 0.5, kv_dot=3))


def _log(*entries: tuple[str, str]) -> str:
    """A sweep log's tail: per (pages, table line) the header and the line, as bench_decode_fp8kv.report prints."""
    out = ["decode_fp8kv fp8_e4m3 B1 L32768 x6 *n64 w4 st3 s16   0.1000 ms"]
    for pages, line in entries:
        out += [f"DECODE_TILES line for {pages} pages (B1, B32 picks):", line, "  check B64 x 4096: the pick was not timed"]
    return "\n".join(out) + "\n"


def test_the_fp8_pick_replaces_its_entry_only(tmp_path):
    source = inspect.getsource(paged)
    log = _log(("fp8_e4m3", PICK), ("bfloat16", table_entry(False, DecodeTile(16, 2, 2), DecodeTile(16, 2, 2))))
    (tmp_path / "sweep.log").write_text(log)
    (tmp_path / "paged.py").write_text(source)
    assert paste.main([str(tmp_path / "sweep.log"), "--source", str(tmp_path / "paged.py")]) == 0
    pasted = (tmp_path / "paged.py").read_text()
    changed = [(a, b) for a, b in zip(source.splitlines(), pasted.splitlines()) if a != b]
    assert changed == [(table_entry(True, *DECODE_TILES[True]), PICK)]
    # the pasted source defines the picked table
    table = _decode_tiles(pasted)
    assert table[True] == (DecodeTile(128, 8, 2, kv_dot=2), DecodeTile(32, 4, 3, 0.5, kv_dot=3))
    assert table[False] == DECODE_TILES[False]


def _decode_tiles(source: str) -> dict:
    """The DECODE_TILES value a module source assigns, evaluated with DecodeTile alone in scope."""
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "DECODE_TILES")
    return eval(ast.get_source_segment(source, node.value), {"DecodeTile": DecodeTile})  # noqa: S307 - our source


def test_the_last_pick_of_a_log_wins_and_other_pages_can_be_named():
    later = table_entry(True, DecodeTile(64, 4, 2), DecodeTile(64, 4, 2))
    bf16 = table_entry(False, DecodeTile(16, 2, 2), DecodeTile(16, 2, 2))
    log = _log(("fp8_e4m3", PICK), ("bfloat16", bf16), ("fp8_e4m3", later))
    assert paste.picked_line(log) == later
    assert paste.picked_line(log, "bfloat16") == bf16


def test_no_pick_or_no_entry_is_an_error_that_leaves_the_source(tmp_path, capsys):
    source = inspect.getsource(paged)
    (tmp_path / "paged.py").write_text(source)
    (tmp_path / "sweep.log").write_text(_log(("fp8_e4m3", "DECODE_TILES fp8_e4m3: no line (a swept shape had no result)")))
    assert paste.main([str(tmp_path / "sweep.log"), "--source", str(tmp_path / "paged.py")]) == 1
    assert "no DECODE_TILES line for fp8_e4m3 pages" in capsys.readouterr().err
    assert (tmp_path / "paged.py").read_text() == source
    with pytest.raises(paste.PasteError, match="0 DECODE_TILES entries for True"):
        paste.paste("DECODE_TILES = {}\n", PICK)
    with pytest.raises(paste.PasteError, match="not a DECODE_TILES entry"):
        paste.paste(source, "True: (DecodeTile(1, 2, 3)")
