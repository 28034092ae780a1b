"""Pure-torch Gated DeltaNet with carried state: the CPU path, and what the Triton / fla-core kernels are tested against.

Each per-sequence rule equals transformers' torch fallback in fp32
(models/qwen3_5: `l2norm`, `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, with use_qk_l2norm_in_kernel), but works
on one unbatched sequence and carries its state explicitly, so a prefill
split anywhere continues exactly where it stopped. `gated_delta_rule_ref`
loops them over a ragged batch whose states live in state-pool slots: prefill
chunks take the chunked rule, single tokens the recurrent one, and
`keep_slots` runs token by token keeping the state after every token
(speculative verification). In-chunk checkpoints (`checkpoints`) keep the
carried state of the chunked pass at 64-token boundaries, adding no operation.

Names: T new tokens, Hk / Hv key / value heads, Dk / Dv key / value head dims,
S slots. The recurrent state is S[h] of shape [Dk, Dv]: a token reads
o = q^T S and writes S <- exp(g) S + k (beta (v - k^T exp(g) S))^T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hkv_kernels.gdn import GDN_CHUNK


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's form, as transformers uses)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GQA-expand q/k to the value heads, go fp32 head-major, l2norm q and k.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] -> q, k: [Hv, T, Dk], v: [Hv, T, Dv] fp32.
    """
    num_k_heads, num_v_heads = k.shape[1], v.shape[1]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads {num_v_heads} not a multiple of key heads {num_k_heads}")
    # each key head serves num_v_heads // num_k_heads consecutive value heads
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    q, k, v = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (q, k, v))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, v


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule token by token (the decode path).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay, <= 0), beta: [T, Hv].
    initial_state: [Hv, Dk, Dv] or None (zeros).
    Returns out: [T, Hv, Dv] in q's dtype and the final state [Hv, Dk, Dv] fp32.
    """
    out_dtype = q.dtype
    q, k, v = _prepare_qkv(q, k, v, use_qk_l2norm)  # [Hv, T, D*]
    # divide (not multiply by the inverse) to stay bit-close to transformers' recurrent path
    q = q / (q.shape[-1] ** 0.5)
    g, beta = (x.transpose(0, 1).to(torch.float32) for x in (g, beta))  # [Hv, T]
    num_v_heads, num_tokens, k_dim = k.shape
    v_dim = v.shape[-1]
    if initial_state is None:
        state = v.new_zeros(num_v_heads, k_dim, v_dim)
    else:
        state = initial_state.to(v)
    out = torch.zeros_like(v)  # [Hv, T, Dv]
    for t in range(num_tokens):
        state = state * g[:, t].exp()[:, None, None]
        kv_mem = (state * k[:, t, :, None]).sum(dim=-2)  # [Hv, Dv]
        delta = (v[:, t] - kv_mem) * beta[:, t, None]  # [Hv, Dv]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1).contiguous().to(out_dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = GDN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule in chunks of `chunk_size` tokens (the prefill path): (out, final state),
    as `chunk_gated_delta_rule_states` computes them."""
    out, state, _ = chunk_gated_delta_rule_states(q, k, v, g, beta, initial_state, use_qk_l2norm, chunk_size)
    return out, state


def chunk_gated_delta_rule_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = GDN_CHUNK,
    keep_after: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gated delta rule in chunks of `chunk_size` tokens, keeping the state at chunk boundaries.

    Within a chunk, the delta-rule writes are folded into one lower-triangular
    (UT) solve; across chunks the state is carried. Same math and op order as
    transformers' torch_chunk_gated_delta_rule. The carried state after the
    first t tokens, t in keep_after (multiples of chunk_size, < T), is returned
    as it is: keeping it adds no operation, so out and the final state do not
    depend on keep_after, and cutting the input at t computes the same state:

        tokens   [0 ... C)[C ... 2C)[2C ... 3C)[3C ... T)      C = chunk_size
        state              ^ after C  ^ after 2C ...             (kept when t is in keep_after)

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay, <= 0), beta: [T, Hv].
    initial_state: [Hv, Dk, Dv] or None (zeros).
    Returns out: [T, Hv, Dv] in q's dtype, the final state [Hv, Dk, Dv] fp32 and the
    kept states, one [Hv, Dk, Dv] fp32 per entry of keep_after, in its order.
    """
    out_dtype = q.dtype
    num_tokens = q.shape[0]
    if any(t <= 0 or t >= num_tokens or t % chunk_size for t in keep_after):
        raise ValueError(f"keep_after {keep_after}: multiples of {chunk_size} inside the {num_tokens} tokens")
    q, k, v = _prepare_qkv(q, k, v, use_qk_l2norm)  # [Hv, T, D*]
    q = q * q.shape[-1] ** -0.5
    g, beta = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (g, beta))  # [Hv, T]
    num_v_heads, _, k_dim = k.shape
    v_dim = v.shape[-1]

    # pad T to whole chunks; padded tokens have k = v = 0 and g = 0, so they change nothing
    pad = (chunk_size - num_tokens % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (num_tokens + pad) // chunk_size

    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(num_v_heads, num_chunks, chunk_size, -1) for x in (q, k, k_beta, v_beta))
    cum_g = g.reshape(num_v_heads, num_chunks, chunk_size).cumsum(dim=-1)  # [Hv, N, C]

    # decay[i, j] = exp(cum_g[i] - cum_g[j]) for j <= i, 0 above the diagonal
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [Hv, N, C, C]
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * cum_g.exp()[..., None]
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        state = new_values.new_zeros(num_v_heads, k_dim, v_dim)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)  # [Hv, N, C, Dv]
    q = q * cum_g.exp()[..., None]
    k = k * (cum_g[..., -1:] - cum_g).exp()[..., None]
    chunk_decay = cum_g[..., -1].exp()[..., None, None]  # [Hv, N, 1, 1]
    wanted, kept = set(keep_after), {}
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state  # [Hv, C, Dv]
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
        if (i + 1) * chunk_size in wanted:
            kept[(i + 1) * chunk_size] = state  # a fresh tensor each chunk: nothing later writes it

    out = out.reshape(num_v_heads, -1, v_dim)[:, :num_tokens]  # [Hv, T, Dv]
    return out.transpose(0, 1).contiguous().to(out_dtype), state, [kept[t] for t in keep_after]


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    q_lens: list[int],
    slots: list[int],
    keep_slots: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    checkpoints: tuple[tuple[int, int, int], ...] = (),
) -> torch.Tensor:
    """Delta rule for each sequence from its slot's state, writing the state back.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay), beta: [T, Hv];
    state: [S, Hv, Dk, Dv] fp32, one layer of the state pool; q_lens, slots: [B].
    keep_slots: None (final state overwrites slots[b]) or [B, max_n] int: the
    state after token t goes to keep_slots[b, t] (entries < 0 skipped), slots[b] untouched.
    checkpoints: (b, tokens, slot) triples (CheckpointMeta.entries): the state of
    sequence b after its first `tokens` tokens (a multiple of the GDN chunk) also goes
    to `slot`, taken from the same chunked pass (not with keep_slots).
    Returns out: [T, Hv, Dv] in q's dtype.
    """
    if checkpoints and keep_slots is not None:
        raise ValueError("in-chunk checkpoints and keep_slots together")
    out = v.new_empty(v.shape, dtype=q.dtype)
    start = 0
    for b, (n, slot) in enumerate(zip(q_lens, slots)):
        if n == 0:
            continue
        rows = slice(start, start + n)
        kept = [(tokens, dst) for seq, tokens, dst in checkpoints if seq == b]
        if keep_slots is None and n > 1:
            out[rows], final, states = chunk_gated_delta_rule_states(
                q[rows], k[rows], v[rows], g[rows], beta[rows], state[slot], use_qk_l2norm,
                keep_after=tuple(tokens for tokens, _ in kept),
            )
            for (_, dst), kept_state in zip(kept, states):
                state[dst].copy_(kept_state)
            state[slot].copy_(final)
        elif keep_slots is None:
            out[rows], final = recurrent_gated_delta_rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], state[slot], use_qk_l2norm
            )
            state[slot].copy_(final)
        else:
            current = state[slot].clone()
            for t in range(n):
                row = slice(start + t, start + t + 1)
                out[row], current = recurrent_gated_delta_rule(
                    q[row], k[row], v[row], g[row], beta[row], current, use_qk_l2norm
                )
                if int(keep_slots[b, t]) >= 0:
                    state[int(keep_slots[b, t])].copy_(current)
        start += n
    return out


def gdn_gates_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token decay and write strength of the delta rule, from the a/b projections
    (transformers' Qwen3.5 / Qwen3-Next gating).

    a, b: [T, Hv] (model dtype); A_log, dt_bias: [Hv].
    Returns g: [T, Hv] fp32 log-decay (<= 0) and beta: [T, Hv] in b's dtype.
    """
    beta = b.sigmoid()
    # A_log goes through fp32 first: in fp16, exp(A_log) can overflow to inf
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta
