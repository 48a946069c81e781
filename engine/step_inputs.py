"""One step's model inputs, built on the host into persistent buffers and copied once.

Per step the runner needs token ids, positions, the slot of each new token, the rows whose
logits are wanted, and per sequence its query start, context length and block table. They are
written with numpy into host buffers made once (pinned on CUDA, so the copies are
asynchronous), then moved in three copies: the int64 part, the int32 part and the block
tables, whatever the batch. The device tensors are views of persistent device buffers, so
a CUDA graph captured over them sees each step's values by replaying. On the CPU the host
buffers are the device buffers and nothing is copied.

Layouts (T tokens, S sequences, R logit rows, W block-table columns), every region 16-byte
aligned (Triton specializes a kernel on its pointers' 16-byte alignment: an odd T would
otherwise compile a second variant of the RoPE and attention kernels while serving):
  int64: ids [T] | positions [T] | slot_mapping [T] | logit rows [R], every T rounded up to
  even
  int32: query_start_loc [S + 1] | seq_lens [S], from S + 1 rounded up to a multiple of 4
  block tables: [S, W] on the host; on the device rows of a [max_seqs, max_blocks] table,
  so its row stride never changes (CUDA graphs bake it in).

On a GPU two sets of host buffers take turns, so the next step is filled while the last
one's copies may still wait in the stream; before a set is written again, the host waits
for the copies made from it two steps before (an event per set), which a step's read has
usually covered already.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmdb.kernels.attention import AttentionBatch
from llmdb.kernels.hidden_cache import HiddenBatch

PAD_SLOT = -1  # a padding row: its K/V is not written, its sequence has no context


def _token_stride(num_tokens: int) -> int:
    """Elements from one int64 region to the next: 16-byte aligned."""
    return num_tokens + (num_tokens & 1)


def _seq_lens_at(num_seqs: int) -> int:
    """Where seq_lens starts in the int32 buffer: 16-byte aligned."""
    return -(-(num_seqs + 1) // 4) * 4


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    batch: AttentionBatch
    logit_rows: torch.Tensor  # [R] int64: rows of the packed tokens whose logits are needed
    # Hidden-cache sequences (after the KV-cache ones, which alone make up `batch`).
    hidden: HiddenBatch | None = None


class BlockTableRows:
    """Each sequence's block table kept in a row of one host table across steps.

    Rewriting every sequence's table every step cost the host about a microsecond per
    sequence, more with long contexts; a decode adds one block every block_size steps. So a
    row stays with its owner, only blocks added since the last step are written, and a step
    gathers its rows in one take (vLLM keeps a persistent batch for the same reason). A row
    follows its owner's block list object: a new list (blocks freed, preempted, converted,
    taken from the prefix cache) is written whole, the same list grown has its tail written.
    The scheduler only ever replaces or extends a request's block list (Request.block_ids).
    """

    def __init__(self, max_seqs: int, max_blocks: int):
        self.table = np.zeros((max_seqs, max_blocks), dtype=np.int32)
        self._entries: dict[str, list] = {}  # owner -> [row, its block list, blocks written]
        self._free = list(range(max_seqs))

    def rows(self, owners: list[str], block_tables: list[list[int]]) -> list[int]:
        """The table rows holding these owners' block lists, brought up to date."""
        out = []
        entries, table = self._entries, self.table
        for owner, blocks in zip(owners, block_tables, strict=True):
            entry = entries.get(owner)
            n = len(blocks)
            if entry is None:
                entry = entries[owner] = [self._free_row(owners), blocks, 0]
            elif entry[1] is not blocks:
                entry[1], entry[2] = blocks, 0
            done = entry[2]
            if n > done:
                table[entry[0], done:n] = blocks[done:] if done else blocks
            entry[2] = n
            out.append(entry[0])
        return out

    def _free_row(self, owners: list[str]) -> int:
        if not self._free:  # rows of sequences that are not in this step go back
            keep = set(owners)
            for owner in [o for o in self._entries if o not in keep]:
                self._free.append(self._entries.pop(owner)[0])
        return self._free.pop()


class StepBuffers:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int,
                 max_blocks: int):
        self.device = device
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        pin = device.type == "cuda"
        # On a GPU two sets of host buffers take turns: the engine fills the next step's
        # while the copies of the one before it may not have run yet.
        self._host_sets = [self._host_set(pin) for _ in range(2 if pin else 1)]
        # Recorded after each set's copies (an event never recorded is waited for at once).
        self._copied = [torch.cuda.Event() for _ in self._host_sets] if pin else []
        self._turn = 0
        self._use_host_set(0)
        self.block_tables = BlockTableRows(max_seqs, max_blocks)
        if pin:
            self.dev64 = torch.zeros_like(self.host64, device=device)
            self.dev32 = torch.zeros_like(self.host32, device=device)
            self.dev_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32,
                                          device=device)
        else:
            self.dev64, self.dev32 = self.host64, self.host32
            self.dev_tables = None

    def fix_table_stride(self) -> None:
        """Block tables in rows of one [max_seqs, max_blocks] table, as on a GPU, where
        CUDA graphs bake its row stride in: for graphs emulated on the CPU (tests)."""
        if self.dev_tables is None:
            self.dev_tables = torch.zeros(self.max_seqs, self.max_blocks, dtype=torch.int32)

    def _host_set(self, pin: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # int64 holds ids, positions, slots, logit rows and the pending tokens' rows and
        # sources (at most one each a sequence): 4 x tokens + 2 x sequences, and alignment.
        t = _token_stride(self.max_tokens)
        return (torch.zeros(4 * t + 2 * self.max_seqs, dtype=torch.int64, pin_memory=pin),
                torch.zeros(_seq_lens_at(self.max_seqs) + self.max_seqs, dtype=torch.int32,
                            pin_memory=pin),
                torch.zeros(self.max_seqs * self.max_blocks, dtype=torch.int32,
                            pin_memory=pin))

    def _use_host_set(self, k: int) -> None:
        self.host64, self.host32, self.host_tables = self._host_sets[k]
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.np_tables = self.host_tables.numpy()

    def views(self, num_tokens: int, num_seqs: int, num_rows: int, width: int,
              block_size: int, max_query_len: int, max_seq_len: int,
              batch_seqs: int | None = None) -> StepInputs:
        """Device views of a step laid out for these sizes (what a CUDA graph captures); the
        attention batch holds the first batch_seqs sequences (default: all)."""
        t, s = num_tokens, num_seqs
        b = s if batch_seqs is None else batch_seqs
        d64, d32 = self.dev64, self.dev32
        if self.dev_tables is not None:
            tables = self.dev_tables[:b]
        else:
            tables = self.host_tables[: s * width].view(s, width)[:b]
        ts, c0 = _token_stride(t), _seq_lens_at(s)
        batch = AttentionBatch(
            query_start_loc=d32[: b + 1], seq_lens=d32[c0 : c0 + b], block_tables=tables,
            slot_mapping=d64[2 * ts : 2 * ts + t], block_size=block_size,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )
        return StepInputs(d64[:t], d64[ts : ts + t], batch, d64[3 * ts : 3 * ts + num_rows])

    def _width(self, ctx: np.ndarray, block_size: int) -> int:
        """Block-table columns the step needs (at least one)."""
        width = max(1, -(-int(ctx.max(initial=0)) // block_size))
        if width > self.max_blocks:
            raise ValueError(f"a sequence of {int(ctx.max())} tokens exceeds the block tables")
        return width

    def _tables(self, owners: list[str], block_tables: list[list[int]], sk: int,
                total_s: int, ctx: np.ndarray, block_size: int) -> np.ndarray:
        """The step's [total_s, width] host block tables, the first sk rows those of the
        KV-cache sequences (the rest are not read)."""
        width = self._width(ctx[:sk], block_size)
        tables = self.np_tables[: total_s * width].reshape(total_s, width)
        if sk:
            rows = self.block_tables.rows(owners[:sk], block_tables[:sk])
            np.take(self.block_tables.table[:, :width], rows, axis=0, out=tables[:sk])
        return tables

    def fill(self, ids: list[int], qlens: list[int], starts: list[int], owners: list[str],
             block_tables: list[list[int]], rows: list[int], block_size: int,
             pad_to: int | None = None, num_kv_seqs: int | None = None,
             pending: tuple[torch.Tensor, list[int], list[int]] | None = None,
             pad_tokens: int | None = None) -> StepInputs:
        """Sequence i computes qlens[i] tokens from position starts[i], over the blocks
        block_tables[i] of owners[i] (a request id: see BlockTableRows); ids are all the
        step's token ids, packed; rows: packed rows whose logits are wanted. pad_to (decode
        graphs) adds sequences of one padding token each, with no context, up to that many;
        with pad_tokens too (mixed graphs) the added sequences are empty and padding tokens,
        past the last sequence, make up that many tokens. Sequences from num_kv_seqs on keep
        hidden states, not K/V: their tokens get slot PAD_SLOT and the attention batch leaves
        them out (the runner adds their HiddenBatch). pending = (sampled, packed rows,
        indices): the ids at those rows are sampled[indices], tokens the host has not read
        yet, copied on the device."""
        if self._copied:  # (two pinned sets taking turns: on a GPU)
            self._turn ^= 1
            self._use_host_set(self._turn)
            self._copied[self._turn].synchronize()  # this set's last copies have run
        s, t = len(qlens), len(ids)
        sk = s if num_kv_seqs is None else num_kv_seqs
        pad_qlen = 0 if pad_tokens else 1  # tokens of each padding sequence
        if pad_tokens:
            assert pad_to is not None and pad_to >= s and pad_tokens >= t
            total_s, total_t = pad_to, pad_tokens
        else:
            total_s, total_t = (pad_to, t + pad_to - s) if pad_to else (s, t)
        if total_t > self.max_tokens or total_s > self.max_seqs:
            raise ValueError(f"a step of {total_t} tokens over {total_s} sequences exceeds the "
                             f"buffers ({self.max_tokens} tokens, {self.max_seqs} sequences)")
        a64, a32 = self.np64, self.np32
        ts, c0 = _token_stride(total_t), _seq_lens_at(total_s)
        tok, pos, slots = (a64[k * ts : k * ts + total_t] for k in range(3))
        loc = a32[: total_s + 1]
        ctx = a32[c0 : c0 + total_s]
        ctx[s:] = 0
        tok[:t] = ids
        if t == s:  # decodes, one token each (every step's common case): vectorized
            loc[: s + 1] = np.arange(s + 1)
            loc[s + 1 :] = s + pad_qlen * np.arange(1, total_s - s + 1)
            p = np.asarray(starts, dtype=np.int64)
            ctx[:s] = p + 1
            tables = self._tables(owners, block_tables, sk, total_s, ctx, block_size)
            pos[:s] = p
            p = p[:sk]
            slots[:sk] = tables[np.arange(sk), p // block_size] * block_size + p % block_size
            slots[sk:s] = PAD_SLOT
        else:  # prefill chunks among decodes: vectorized over the packed tokens too
            q = np.asarray(qlens, dtype=np.int64)
            loc[0] = 0
            np.cumsum([*qlens, *([pad_qlen] * (total_s - s))], out=loc[1:])
            a = np.asarray(starts, dtype=np.int64)
            ctx[:s] = a + q
            tables = self._tables(owners, block_tables, sk, total_s, ctx, block_size)
            # Token j of sequence i sits at packed row loc[i] + j and position a[i] + j.
            p = np.arange(t) + np.repeat(a - loc[:s], q)
            pos[:t] = p
            nk = int(loc[sk])  # the tokens of KV-cache sequences come first
            seq = np.repeat(np.arange(sk), q[:sk])
            p = p[:nk]
            slots[:nk] = tables[seq, p // block_size] * block_size + p % block_size
            slots[nk:t] = PAD_SLOT
        # Padding tokens: token 0 at position 0, nowhere in the cache; padding sequences have
        # no context (ctx above) and block 0 in their table.
        tok[t:], pos[t:], slots[t:] = 0, 0, PAD_SLOT
        tables[s:] = 0
        n64 = 3 * ts + len(rows)
        a64[3 * ts : n64] = rows
        if pending is not None:
            sampled, pending_rows, indices = pending
            p0, n64 = n64, n64 + 2 * len(pending_rows)
            a64[p0:n64] = [*pending_rows, *indices]
        width = tables.shape[1]
        if self.dev_tables is not None:
            n32 = c0 + total_s
            self.dev64[:n64].copy_(self.host64[:n64], non_blocking=True)
            self.dev32[:n32].copy_(self.host32[:n32], non_blocking=True)
            host_view = self.host_tables[: total_s * width].view(total_s, width)
            self.dev_tables[:total_s, :width].copy_(host_view, non_blocking=True)
            if self._copied:
                self._copied[self._turn].record(torch.cuda.current_stream(self.device))
        max_q = 0 if not sk else 1 if t == s else int((loc[1 : sk + 1] - loc[:sk]).max())
        inputs = self.views(total_t, total_s, len(rows), width, block_size, max_q,
                            int(ctx[:sk].max(initial=0)), None if pad_to else sk)
        if pending is not None:
            k = len(pending_rows)
            where, source = self.dev64[p0 : p0 + k], self.dev64[p0 + k : p0 + 2 * k]
            inputs.input_ids.index_copy_(0, where, sampled.index_select(0, source))
        return inputs
