"""Cascade decode attention: decode rows that share their first KV blocks (a system prompt held once by the
prefix cache) read those blocks once per step for all of them, then each its own blocks; the two partial
softmaxes are merged exactly (log-sum-exp, fp32). CascadeLayout says which rows share what; the PyTorch
reference here defines the result, which is paged_decode_attention's (tokenbus_kernels/reference.py) to rounding.

    shared part   one group's prefix K/V [prefix_len, Hk, D] against all its members' queries and every GQA
                  head at once: scores [Hk, members * group, prefix_len], one matrix product per KV head
    own part      each row's tokens suffix_start .. seq_len - 1 (its new token included), as plain decode
    merge         m = max(m1, m2); out = (acc1 e^(m1-m) + acc2 e^(m2-m)) / (l1 e^(m1-m) + l2 e^(m2-m))

A sliding window applies to both parts per row: a row at position p sees keys p - window < t <= p, so a
window that starts inside the prefix masks that row's older prefix keys, and one that starts past it leaves
the row nothing of the prefix (an empty partial: m = -inf, l = 0, which the merge weighs 0). Soft-capping
is applied to each score before masking, as everywhere. The C++ (csrc/cpu_cascade_attention.cpp) and
Triton (cascade_attention.py) kernels compute the same thing; tests/kernels/test_cascade*.py compare them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbus_kernels.reference import _context, _soft_cap


@dataclass
class CascadeLayout:
    """Which decode rows share their first tokens' KV blocks. Group g's members are the rows
    group_rows[group_starts[g]:group_starts[g + 1]]; their first prefix_lens[g] tokens have the same K/V (in
    the engine: the same physical blocks, so prefix_lens[g] is a whole number of blocks), which the kernels
    read through the first member's table row; prefix_lens[g] <= every member's seq_len. A row is in at most
    one group; suffix_starts[row] is its group's prefix_len (0 for a row in none), where its own part starts.

    Padded (build's capacity; a CUDA graph's static layout, worker/engine/cuda_graphs.py): group_rows has an
    entry per row, the real members first, and empty groups (no member, prefix 0) follow the real ones up to a
    fixed count. The kernels' grids depend only on those two shapes and max_prefix_len, then an upper bound
    (the table width), so one captured launch serves every grouping of its rows."""

    group_rows: torch.Tensor  # int32 [num_grouped_rows]
    group_starts: torch.Tensor  # int32 [num_groups + 1]
    prefix_lens: torch.Tensor  # int32 [num_groups]
    suffix_starts: torch.Tensor  # int32 [num_seqs]
    max_prefix_len: int  # host copy of prefix_lens.max() (or a bound on it): the Triton prefix stage's partitions
    packed: torch.Tensor | None = None  # the four arrays back to back (views of it), as build makes them

    @property
    def num_groups(self) -> int:
        return self.prefix_lens.shape[0]

    @classmethod
    def views(cls, packed: torch.Tensor, num_grouped: int, num_groups: int, max_prefix_len: int) -> CascadeLayout:
        """The layout whose arrays lie in `packed` as build packs them: rows, starts, lens, then suffix starts."""
        a, b = num_grouped, num_grouped + num_groups + 1
        c = b + num_groups
        return cls(packed[:a], packed[a:b], packed[b:c], packed[c:], max_prefix_len, packed)

    @staticmethod
    def pack(groups: list[tuple[list[int], int]], num_seqs: int,
             capacity: int | None = None) -> tuple[list[int], int, int, int]:
        """The four arrays back to back on the host (group rows, starts, prefix lens, suffix starts) from (member
        rows, prefix tokens) pairs, and (grouped rows, groups, longest prefix) to view them with. capacity:
        padded to num_seqs grouped-row entries and `capacity` groups (the class docstring)."""
        rows = [r for members, _ in groups for r in members]
        if len(rows) != len(set(rows)) or any(not 0 <= r < num_seqs for r in rows):
            raise ValueError(f"cascade groups must name distinct rows below {num_seqs}, got {groups}")
        if capacity is not None and len(groups) > capacity:
            raise ValueError(f"{len(groups)} cascade groups do not fit a layout padded to {capacity}")
        starts, suffix = [0], [0] * num_seqs
        for members, prefix_len in groups:
            starts.append(starts[-1] + len(members))
            for r in members:
                suffix[r] = prefix_len
        lens = [prefix_len for _, prefix_len in groups]
        longest = max(lens, default=0)
        if capacity is not None:
            rows += [0] * (num_seqs - len(rows))
            starts += [starts[-1]] * (capacity - len(groups))
            lens += [0] * (capacity - len(groups))
        return rows + starts + lens + suffix, len(rows), len(lens), longest

    @classmethod
    def build(cls, groups: list[tuple[list[int], int]], num_seqs: int, device: torch.device | str = "cpu",
              capacity: int | None = None) -> CascadeLayout:
        """pack's layout on `device`, in one host-to-device copy (the engine sends it inside its step's one
        copy instead: worker/engine/step_inputs.py)."""
        values, grouped, num_groups, longest = cls.pack(groups, num_seqs, capacity)
        return cls.views(torch.tensor(values, dtype=torch.int32).to(device), grouped, num_groups, longest)


def _partial(scores: torch.Tensor, invalid: torch.Tensor, values: torch.Tensor,
             equation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(running max, sum, unnormalised accumulator) of scores [..., T] with `invalid` keys masked; a row with no
    valid key gets (-inf, 0, 0). equation: the einsum of the weights with `values`."""
    scores = scores.masked_fill(invalid, float("-inf"))  # also overwrites NaN from junk keys
    m = scores.amax(dim=-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all masked: e^(-inf - 0) = 0, not NaN
    p = torch.exp(scores - m_safe[..., None])
    return m, p.sum(dim=-1), torch.einsum(equation, p, values)


def merge_partials(first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The normalised output of two partials (m, l, acc) of the same rows, merged by log-sum-exp."""
    (m1, l1, a1), (m2, l2, a2) = first, second
    m = torch.maximum(m1, m2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return (a1 * w1[..., None] + a2 * w2[..., None]) / (l1 * w1 + l2 * w2)[..., None]


def cascade_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: CascadeLayout,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """paged_decode_attention_ref's result (q [num_seqs, num_q_heads, head_dim] -> the same shape), computed
    as a cascade over `layout`'s groups."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    lens = seq_lens.to(q.device).long()
    starts = layout.suffix_starts.to(q.device).long()
    # own part: every row's tokens suffix_start .. seq_len - 1, gathered as whole blocks (junk past them zeroed)
    max_len = int(lens.max().item()) if num_seqs else 0
    keys, values = _context(k_cache, v_cache, block_tables, max(1, -(-max_len // block_size)))
    pos = torch.arange(keys.shape[1], device=q.device)[None, :]
    invalid = (pos >= lens[:, None]) | (pos < starts[:, None])
    if window:
        invalid |= pos < lens[:, None] - window
    values.masked_fill_(invalid[:, :, None, None], 0.0)
    scores = _soft_cap(torch.einsum("skgd,stkd->skgt", qg, keys) * scale, softcap)
    m, total, acc = _partial(scores, invalid[:, None, None, :], values, "skgt,stkd->skgd")
    # shared part, per group: its prefix against all its members' rows and heads at once
    pm, pl = torch.full_like(m, float("-inf")), torch.zeros_like(total)
    pacc = torch.zeros_like(acc)
    bounds = layout.group_starts.tolist()
    rows_all = layout.group_rows.long().to(q.device)
    for g, prefix_len in enumerate(layout.prefix_lens.tolist()):
        rows = rows_all[bounds[g] : bounds[g + 1]]
        if prefix_len == 0 or rows.numel() == 0:
            continue
        table = block_tables[rows[:1]]
        pk, pv = (c[0, :prefix_len] for c in _context(k_cache, v_cache, table, -(-prefix_len // block_size)))
        ppos = torch.arange(prefix_len, device=q.device)[None, :]
        pinvalid = ppos < lens[rows, None] - window if window else torch.zeros(len(rows), prefix_len, dtype=torch.bool,
                                                                                device=q.device)
        s = _soft_cap(torch.einsum("mkgd,pkd->mkgp", qg[rows], pk) * scale, softcap)
        pm[rows], pl[rows], pacc[rows] = _partial(s, pinvalid[:, None, None, :], pv, "mkgp,pkd->mkgd")
    out = merge_partials((pm, pl, pacc), (m, total, acc))
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)
