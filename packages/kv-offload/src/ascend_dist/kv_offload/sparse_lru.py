"""Sparse KV offload: per-row LRU residency of the device hot buffer.

Runs in: the worker process, once per decode step and layer (numpy + Python; no torch, no I/O).

Each decode row owns ``cap = topk_buffer_size`` slots. Per step, the row's top-k tokens that already
sit in a slot are hits (no copy); the others take the least-recently-used slots and are copied from
the host pool. A slot holding a token at or beyond the row's stable prefix is cleared first (the
speculative suffix may have been rewritten on the host). A row whose request changed starts empty.

Request identity is a 64-bit id handed out once per request at admission (`RequestIds`), not a
32-bit checksum of the id string, so two requests can never be confused. Address planning
writes size 0 for skipped entries rather than leaving stale descriptors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ascend_dist.common.errors import ConfigError

__all__ = ["LruResidency", "MissPlan", "RequestIds", "miss_descriptors", "mtp_dummy_identity", "token_to_request"]

_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class MissPlan:
    """One step of one layer: slots per top-k position and the misses to copy.

    Attributes:
        current_slots: ``[rows, topk]`` slot of each top-k position (-1: invalid position).
        miss_tokens / miss_slots: ``[rows, topk]`` the i-th miss of a row and its slot (-1 padded).
        miss_count: ``[rows]`` misses per row.
    """

    current_slots: _I64
    miss_tokens: _I64
    miss_slots: _I64
    miss_count: _I64


class LruResidency:
    """The residency state of one layer's hot buffer (``rows x cap`` slots)."""

    def __init__(self, rows: int, cap: int, topk: int, max_model_len: int) -> None:
        """Create empty rows.

        Raises:
            ConfigError: a non-positive size, or ``cap < topk``.
        """
        for name, value in (
            ("rows", rows),
            ("topk_buffer_size", cap),
            ("topk", topk),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ConfigError(name, value, "a positive integer")
        if cap < topk:
            raise ConfigError("topk_buffer_size", cap, f">= topk ({topk})")
        self.rows, self.cap, self.topk, self.max_model_len = rows, cap, topk, max_model_len
        self.slot_to_token = np.full((rows, cap), -1, dtype=np.int64)
        self.lru = np.tile(np.arange(cap, dtype=np.int64), (rows, 1))
        self.last_req = np.full(rows, -1, dtype=np.int64)

    def step(self, topk_tokens: _I64, req_ids: Sequence[int] | _I64, stable_prefix: Sequence[int] | _I64) -> MissPlan:
        """Plan one step for rows ``0..len(req_ids)-1``.

        Raises:
            ConfigError: more rows than the buffer has, or a top-k width other than ``topk``.
        """
        tokens = np.asarray(topk_tokens, dtype=np.int64)
        n = len(req_ids)
        if n > self.rows or tokens.shape != (n, self.topk):
            raise ConfigError("topk_indices", tokens.shape, f"[rows <= {self.rows}, {self.topk}]")
        plan = MissPlan(
            np.full((n, self.topk), -1, dtype=np.int64),
            np.full((n, self.topk), -1, dtype=np.int64),
            np.full((n, self.topk), -1, dtype=np.int64),
            np.zeros(n, dtype=np.int64),
        )
        for row in range(n):
            self._row(row, tokens[row].tolist(), int(req_ids[row]), int(stable_prefix[row]), plan)
        return plan

    def _row(self, row: int, topk: list[int], req: int, stable: int, plan: MissPlan) -> None:
        s2t = self.slot_to_token[row]
        if self.last_req[row] != req:
            s2t.fill(-1)
            self.lru[row] = np.arange(self.cap)
            self.last_req[row] = req
        stable = min(max(stable, 0), self.max_model_len)
        pos: dict[int, int] = {}
        for p, t in enumerate(topk):
            if 0 <= t < self.max_model_len and t not in pos:
                pos[t] = p
        current = plan.current_slots[row]
        hits: list[int] = []
        evictable: list[int] = []
        for slot in self.lru[row].tolist():
            if not 0 <= slot < self.cap:
                continue
            token = int(s2t[slot])
            if token >= stable:
                s2t[slot] = token = -1
            if token >= 0 and token in pos and current[pos[token]] < 0:
                current[pos[token]] = slot
                hits.append(slot)
            else:
                evictable.append(slot)
        misses = [(p, t) for p, t in enumerate(topk) if 0 <= t < self.max_model_len and current[p] < 0]
        taken = min(len(misses), len(evictable))
        for i, ((p, t), slot) in enumerate(zip(misses[:taken], evictable[:taken], strict=True)):
            s2t[slot] = t
            current[p] = slot
            plan.miss_tokens[row, i] = t
            plan.miss_slots[row, i] = slot
        plan.miss_count[row] = taken
        self.lru[row] = evictable[taken:] + evictable[:taken] + hits


def miss_descriptors(
    plan: MissPlan,
    block_table: _I64,
    *,
    host_k: int,
    host_v: int,
    dev_k: int,
    dev_v: int,
    token_k_bytes: int,
    token_v_bytes: int,
    block_size: int,
    cap: int,
) -> tuple[_I64, _I64, _I64]:
    """Host -> hot-buffer copies of every miss: K descriptors ``[0, N)`` then V ``[N, 2N)``.

    Host address of token t of row r: ``base + table[r][t // block_size] * block_size * tb +
    (t % block_size) * tb``; device address of slot s: ``dev + (r * cap + s) * tb``. Entries that
    cannot be addressed (bad slot, block beyond the table, null table entry) get size 0.

    Returns:
        ``(src, dst, sizes)`` int64 arrays of length ``2N``.
    """
    table = np.asarray(block_table, dtype=np.int64)
    rows, width = table.shape
    counts = np.clip(plan.miss_count[:rows], 0, plan.miss_tokens.shape[1])
    mask = np.arange(plan.miss_tokens.shape[1])[None, :] < counts[:, None]
    r_idx, i_idx = np.nonzero(mask)
    tokens = plan.miss_tokens[r_idx, i_idx]
    slots = plan.miss_slots[r_idx, i_idx]
    blk_idx = np.where(tokens >= 0, tokens // block_size, width)
    entry = np.where(blk_idx < width, table[r_idx, np.minimum(blk_idx, width - 1)], -1)
    ok = (tokens >= 0) & (slots >= 0) & (slots < cap) & (entry >= 0)
    blk, off = np.maximum(entry, 0), np.maximum(tokens, 0) % block_size
    dslot = r_idx * cap + np.clip(slots, 0, cap - 1)
    src_k = host_k + (blk * block_size + off) * token_k_bytes
    src_v = host_v + (blk * block_size + off) * token_v_bytes
    dst_k = dev_k + dslot * token_k_bytes
    dst_v = dev_v + dslot * token_v_bytes
    sizes = np.concatenate([np.where(ok, token_k_bytes, 0), np.where(ok, token_v_bytes, 0)])
    return np.concatenate([src_k, src_v]), np.concatenate([dst_k, dst_v]), sizes.astype(np.int64)


class RequestIds:
    """64-bit request identities handed out at admission (never reused while the process lives)."""

    def __init__(self) -> None:
        """Start at 1 (0 marks padded rows)."""
        self._next = 1
        self._ids: dict[str, int] = {}

    def admit(self, req_id: str) -> int:
        """The id of ``req_id``, assigned on first sight."""
        if req_id not in self._ids:
            self._ids[req_id] = self._next
            self._next += 1
        return self._ids[req_id]

    def release(self, req_id: str) -> None:
        """Forget a finished request (its number is never handed out again)."""
        self._ids.pop(req_id, None)

    def row_ids(self, req_ids: Sequence[str], num_rows: int) -> _I64:
        """Ids of the batch's requests, zero-padded to ``num_rows``."""
        out = np.zeros(num_rows, dtype=np.int64)
        out[: len(req_ids)] = [self.admit(r) for r in req_ids]
        return out


def token_to_request(query_start_loc: Sequence[int], num_tokens: int) -> _I64:
    """Index of the request owning each scheduled token (padded tokens -> 0).

    Raises:
        ConfigError: the offsets decrease, or cover more than ``num_tokens`` tokens.
    """
    starts = np.asarray(query_start_loc, dtype=np.int64)
    lengths = np.diff(starts)
    if lengths.size and int(lengths.min()) < 0:
        raise ConfigError("query_start_loc", list(starts), "non-decreasing offsets")
    owners = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    if owners.size > num_tokens:
        raise ConfigError("num_tokens", num_tokens, f">= the {owners.size} tokens the queries cover")
    out = np.zeros(num_tokens, dtype=np.int64)
    out[: owners.size] = owners
    return out


def mtp_dummy_identity(num_reqs: int, query_start_loc: Sequence[int], num_tokens: int) -> tuple[_I64, _I64]:
    """Drafter dummy runs: distinct non-zero ids ``1..num_reqs`` and their token owners."""
    return np.arange(1, num_reqs + 1, dtype=np.int64), token_to_request(query_start_loc, num_tokens)
