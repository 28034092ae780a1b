"""Per-step kernel metadata, built once on the host and moved to the device in one copy.

A step's kernels all read the same few integer arrays: where each sequence's
new tokens start, how many there are, how long its KV is, which page-table row
and state slot it uses, and the (sequence, first token) blocks each kernel's
grid walks. `StepArena` packs every such array of a step into one pinned host
buffer, copies it to the device with one transfer, and hands out views;
`KernelMeta` is the set of views the kernels take. No kernel launcher builds
metadata or copies host to device, so a forward can be captured in a CUDA graph.

    arena (int64)  [ input_ids | positions | slot_mapping | ... | conv_block_tok ]
                     each field starts 16-byte aligned; decode graphs keep one fixed layout

Pure Python and numpy plus torch tensors: importing it never imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hkv_kernels.gdn import GDN_CHUNK

CONV_BLOCK_T = 16  # tokens per conv program (the conv kernel's BLOCK_T)
_ALIGN = 2  # int64 elements per 16 bytes


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def attention_tile(max_q_len: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the paged attention kernel, from the H200 sweep
    in docs/kernels.md.

    Decode: few rows, long key blocks to keep many loads in flight. Prefill: wide row tiles.
    Head dims above 128 get a smaller, unmeasured prefill tile so registers and shared memory fit.
    fp32 (exact ieee dots, the parity mode) gets small tiles: its dots unroll into scalar FMAs,
    and with the bf16 prefill tile the head-dim-128 case did not compile within ~70 s on an H200.
    """
    decode = max_q_len <= 4
    decode_rows = max(16, next_pow2(group * max(max_q_len, 1)))
    if dtype == torch.float32:
        return (decode_rows, 64, 4, 2) if decode else (max(64, next_pow2(group)), 32, 4, 2)
    if decode:
        return decode_rows, 128, 4, 3
    if head_dim <= 128:
        return max(256, next_pow2(group)), 64, 8, 2
    return max(64, next_pow2(group)), 64, 4, 2


def ragged_blocks(q_lens: np.ndarray, block_t: int) -> tuple[np.ndarray, np.ndarray]:
    """(block_seq, block_tok): block i covers tokens block_tok[i] .. + block_t - 1 of sequence
    block_seq[i]; sequences with no new tokens get no block.

        q_lens   [3, 0, 17]  block_t 16  ->  block_seq [0, 2, 2], block_tok [0, 0, 16]
    """
    counts = -(-q_lens // block_t)  # [B] blocks per sequence
    block_seq = np.repeat(np.arange(len(q_lens)), counts)
    first = np.cumsum(counts) - counts  # [B] index of each sequence's first block
    block_tok = (np.arange(int(counts.sum())) - first[block_seq]) * block_t
    return block_seq, block_tok


@dataclass(frozen=True)
class KernelMeta:
    """The per-sequence and per-block arrays every CUDA kernel of a step reads (int64 device views).

    q_start, q_len, kv_len, table_rows: [B]; attn_block_*: the paged attention grid for
    `attn_tile`; conv_block_*: the conv grid (CONV_BLOCK_T tokens per block); cu_seqlens:
    [B + 1] token offsets (fla's varlen prefill), with cu_seqlens_host its CPU copy.
    max_q_len: the longest sequence's new tokens (picks tiles and code paths on the host).
    """

    q_start: torch.Tensor
    q_len: torch.Tensor
    kv_len: torch.Tensor
    table_rows: torch.Tensor
    attn_block_seq: torch.Tensor
    attn_block_tok: torch.Tensor
    attn_tile: tuple[int, int, int, int]
    attn_block_t: int  # tokens per attention block: the grid above was cut for this
    conv_block_seq: torch.Tensor
    conv_block_tok: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    max_q_len: int
    # fla-core's varlen chunk metadata, made once per step with the rest (every fla kernel of every
    # layer takes it instead of deriving it from cu_seqlens, which syncs): [NT, 2] (sequence,
    # chunk within it) per 64-token chunk, and [B + 1] each sequence's first chunk
    fla_chunk_indices: torch.Tensor | None = None
    fla_chunk_offsets: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.q_len.shape[0]


@dataclass(frozen=True)
class CheckpointMeta:
    """A prefill step's in-chunk checkpoints: int64 device views [N] (decode steps have none).

    Checkpoint i keeps the linear state of sequence seq[i] after its first tokens[i] new
    tokens (0 < tokens[i] < q_len[seq[i]], a multiple of GDN_CHUNK) in state slot slots[i],
    every linear layer; rows[i] = q_start[seq[i]] + tokens[i], the flat row after it, and
    h_rows[i] the GDN chunk starting there, counted across the step's sequences (fla-core's
    chunk states are indexed so: h[h_rows[i]] is the state before that chunk):

        flat rows   [q_start ............ rows[i]) [rows[i] ...... q_start + q_len)
        recurrent   the state after row rows[i] - 1 goes to slots[i]
        conv        rows rows[i] - (K-1) .. rows[i] - 1 of the conv input, oldest first

    Entries may repeat (a captured graph pads its fixed number with copies of one): a repeated
    entry writes the same state to the same slot. Nothing here is read on the host, so a graph
    can capture the kernels that use it.
    """

    seq: torch.Tensor
    tokens: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    h_rows: torch.Tensor

    def entries(self) -> tuple[tuple[int, int, int], ...]:
        """(seq, tokens, slot) per checkpoint, read back (CPU references only: on CUDA it syncs)."""
        return tuple(zip(self.seq.tolist(), self.tokens.tolist(), self.slots.tolist()))


def checkpoint_arrays(entries: tuple[tuple[int, int, int], ...], q_lens: np.ndarray) -> dict[str, np.ndarray]:
    """CheckpointMeta's arena fields for `entries` ((seq, tokens, slot) triples; q_lens: [B] new tokens)."""
    table = np.asarray(entries, dtype=np.int64).reshape(-1, 3)
    q_lens = np.asarray(q_lens, dtype=np.int64)
    q_start = np.cumsum(q_lens) - q_lens
    chunks = -(-q_lens // GDN_CHUNK)
    first_chunk = np.cumsum(chunks) - chunks
    return {"ckpt_seq": table[:, 0], "ckpt_tokens": table[:, 1], "ckpt_slots": table[:, 2],
            "ckpt_rows": q_start[table[:, 0]] + table[:, 1],
            "ckpt_hrows": first_chunk[table[:, 0]] + table[:, 1] // GDN_CHUNK}


def checkpoint_meta(views: dict[str, torch.Tensor]) -> CheckpointMeta | None:
    """CheckpointMeta over an arena's views (packed from checkpoint_arrays); None without checkpoints."""
    if "ckpt_seq" not in views or not len(views["ckpt_seq"]):
        return None
    return CheckpointMeta(views["ckpt_seq"], views["ckpt_tokens"], views["ckpt_slots"], views["ckpt_rows"],
                          views["ckpt_hrows"])


class StepArena:
    """A pinned host buffer and a device buffer of int64; `pack` lays out named arrays in both.

    `pack` writes every array into the host buffer and copies the used prefix to the
    device in one non-blocking transfer (pinned, so it is ordered on the current stream and
    the host buffer must not be refilled before that copy ran: `pack` waits on the previous
    step's copy event before writing). With `layout` given (decode graphs) the fields keep
    fixed offsets and lengths, so captured kernels read the same addresses every replay.
    """

    def __init__(self, capacity: int, device: torch.device):
        self.capacity: int = capacity
        self.device: torch.device = device
        pin = device.type == "cuda"
        self.host: torch.Tensor = torch.zeros(capacity, dtype=torch.int64, pin_memory=pin)
        self.host_np: np.ndarray = self.host.numpy()
        self.dev: torch.Tensor = torch.zeros(capacity, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None  # the last host -> device copy

    @staticmethod
    def layout_of(lengths: dict[str, int]) -> dict[str, tuple[int, int]]:
        """name -> (offset, length), each offset 16-byte aligned, in the order given."""
        out, offset = {}, 0
        for name, n in lengths.items():
            out[name] = (offset, n)
            offset += -(-n // _ALIGN) * _ALIGN
        return out

    def pack(self, arrays: dict[str, np.ndarray], layout: dict[str, tuple[int, int]] | None = None
             ) -> dict[str, torch.Tensor]:
        """Device views of `arrays` (int64), filled by one copy. With a fixed `layout`, an array
        shorter than its field leaves the rest of the field as it was (padding is the caller's)."""
        if layout is None:
            layout = self.layout_of({name: len(a) for name, a in arrays.items()})
        end = max((off + n for off, n in layout.values()), default=0)
        if end > self.capacity:
            raise ValueError(f"step metadata needs {end} ints, the arena holds {self.capacity}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy still reads the host buffer
        for name, values in arrays.items():
            off, n = layout[name]
            if len(values) > n:
                raise ValueError(f"{name}: {len(values)} values for a field of {n}")
            self.host_np[off : off + len(values)] = values
        if end:
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
        return {name: self.dev[off : off + n] for name, (off, n) in layout.items()}


def meta_arrays(q_lens: np.ndarray, kv_lens: np.ndarray, table_rows: np.ndarray, attn_block_t: int,
                gdn_chunks: bool = True) -> dict[str, np.ndarray]:
    """The per-sequence and per-block arrays of KernelMeta, as numpy int64 (field name -> values);
    gdn_chunks False leaves out fla's chunk metadata (decode graphs never run the chunk path)."""
    q_start = np.cumsum(q_lens) - q_lens
    attn_seq, attn_tok = ragged_blocks(q_lens, attn_block_t)
    conv_seq, conv_tok = ragged_blocks(q_lens, CONV_BLOCK_T)
    arrays = {
        "q_start": q_start, "q_len": q_lens, "kv_len": kv_lens, "table_rows": table_rows,
        "attn_block_seq": attn_seq, "attn_block_tok": attn_tok,
        "conv_block_seq": conv_seq, "conv_block_tok": conv_tok,
        "cu_seqlens": np.concatenate(([0], np.cumsum(q_lens))),
    }
    if gdn_chunks:
        fla_seq, fla_tok = ragged_blocks(q_lens, GDN_CHUNK)
        arrays["fla_chunk_indices"] = np.stack([fla_seq, fla_tok // GDN_CHUNK], 1).reshape(-1)
        arrays["fla_chunk_offsets"] = np.concatenate(([0], np.cumsum(-(-q_lens // GDN_CHUNK))))
    return arrays


def kernel_meta(views: dict[str, torch.Tensor], q_lens: np.ndarray, attn_tile: tuple[int, int, int, int],
                attn_block_t: int) -> KernelMeta:
    """KernelMeta over an arena's views (`views` holds at least meta_arrays' fields, the attention
    blocks cut for `attn_block_t` tokens)."""
    cu_host = torch.from_numpy(np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64))
    return KernelMeta(
        q_start=views["q_start"], q_len=views["q_len"], kv_len=views["kv_len"], table_rows=views["table_rows"],
        attn_block_seq=views["attn_block_seq"], attn_block_tok=views["attn_block_tok"], attn_tile=attn_tile,
        attn_block_t=attn_block_t, conv_block_seq=views["conv_block_seq"], conv_block_tok=views["conv_block_tok"],
        cu_seqlens=views["cu_seqlens"], cu_seqlens_host=cu_host, max_q_len=int(q_lens.max(initial=0)),
        fla_chunk_indices=views["fla_chunk_indices"].view(-1, 2) if "fla_chunk_indices" in views else None,
        fla_chunk_offsets=views.get("fla_chunk_offsets"),
    )


def build_meta(q_lens, kv_lens, device, group: int, head_dim: int, dtype: torch.dtype,
               table_rows=None) -> KernelMeta:
    """KernelMeta from python lists in a fresh arena (kernel tests and benchmarks; the runner
    packs metadata together with the step's token arrays instead)."""
    q = np.asarray(q_lens, dtype=np.int64)
    rows = np.arange(len(q)) if table_rows is None else np.asarray(table_rows, dtype=np.int64)
    tile = attention_tile(int(q.max(initial=1)), group, head_dim, dtype)
    block_t = max(1, tile[0] // group)
    arrays = meta_arrays(q, np.asarray(kv_lens, dtype=np.int64), rows, block_t)
    arena = StepArena(sum(len(a) + _ALIGN for a in arrays.values()) + _ALIGN, torch.device(device))
    return kernel_meta(arena.pack(arrays), q, tile, block_t)
