"""Step inputs: the block tables kept across steps (BlockTableRows) give each step exactly the
tables and slots that writing every table afresh would."""

import random

import torch

from llmdb.engine.step_inputs import PAD_SLOT, BlockTableRows, StepBuffers

BS = 4


def expected_slots(tables: list[list[int]], starts: list[int], qlens: list[int]) -> list[int]:
    return [tables[i][p // BS] * BS + p % BS
            for i, (a, q) in enumerate(zip(starts, qlens, strict=True)) for p in range(a, a + q)]


def test_rows_follow_growth_replacement_and_eviction():
    rows = BlockTableRows(max_seqs=3, max_blocks=8)
    a, b = [1, 2], [5]
    ra, rb = rows.rows(["a", "b"], [a, b])
    a.append(3)  # a decode's new block: only the tail is written
    assert rows.rows(["a", "b"], [a, b]) == [ra, rb]
    assert rows.table[ra, :3].tolist() == [1, 2, 3]
    a = [7]  # preempted and readmitted, or converted: a new list, written whole
    rows.rows(["a"], [a])
    assert rows.table[ra, 0] == 7
    # A fourth owner with every row taken: owners outside the step give theirs back.
    rows.rows(["c"], [[9]])
    rd = rows.rows(["d", "a"], [[4, 4], a])
    assert len(set(rd)) == 2 and rows.table[rd[0], :2].tolist() == [4, 4]
    assert rows.table[rd[1], 0] == 7


def test_fill_over_many_steps_equals_fresh_tables():
    """Random steps of decodes and prefill chunks over block lists that grow, get replaced
    and come and go: every step's tables and slots are those of its block lists."""
    rng = random.Random(0)
    buffers = StepBuffers(torch.device("cpu"), max_tokens=256, max_seqs=6, max_blocks=16)
    live: dict[str, tuple[list[int], int]] = {}  # owner -> (blocks, tokens computed)
    next_id = 0
    for _ in range(300):
        while not live or (len(live) < 6 and rng.random() < 0.3):
            live[f"r{next_id}"] = ([], 0)
            next_id += 1
        owners = rng.sample(sorted(live), rng.randint(1, len(live)))
        decode = rng.random() < 0.5
        tables, starts, qlens = [], [], []
        for o in owners:
            blocks, done = live[o]
            if rng.random() < 0.05:  # preempted: a new, empty list; recomputed from 0
                blocks, done = [], 0
            q = 1 if decode else rng.randint(1, 7)
            if done + q > 60:  # (the block tables hold 64 tokens) finished and readmitted
                blocks, done = [], 0
            while len(blocks) * BS < done + q:
                blocks.append(rng.randrange(1000))
            live[o] = (blocks, done + q)
            tables.append(blocks)
            starts.append(done)
            qlens.append(q)
        ids = [rng.randrange(1000) for _ in range(sum(qlens))]
        inputs = buffers.fill(ids, qlens, starts, owners, tables, [], BS)
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == [p for a, q in zip(starts, qlens, strict=True)
                                             for p in range(a, a + q)]
        got = inputs.batch.block_tables
        for i, blocks in enumerate(tables):
            assert got[i, : len(blocks)].tolist() == blocks
        assert inputs.batch.slot_mapping.tolist() == expected_slots(tables, starts, qlens)
        assert inputs.batch.seq_lens.tolist() == [a + q for a, q in zip(starts, qlens,
                                                                           strict=True)]
        for o in list(live):
            if rng.random() < 0.05:
                del live[o]  # finished: its row is given back when rows run out


def test_hidden_sequences_and_padding_get_no_slots():
    buffers = StepBuffers(torch.device("cpu"), max_tokens=64, max_seqs=8, max_blocks=4)
    inputs = buffers.fill([1, 2, 3], [1, 1, 1], [5, 2, 9], ["a", "b", "c"],
                          [[3, 4], [8], [6, 1, 2]], [], BS, num_kv_seqs=2)
    assert inputs.batch.slot_mapping.tolist() == [4 * BS + 1, 8 * BS + 2, PAD_SLOT]
    tables = inputs.batch.block_tables
    assert tables.shape[0] == 2 and tables[0, :2].tolist() == [3, 4] and tables[1, 0] == 8
    mixed = buffers.fill([1, 2, 3, 4, 5], [2, 1, 2], [5, 2, 0], ["a", "b", "c"],
                         [[3, 4], [8], [6, 1, 2]], [], BS, num_kv_seqs=2)
    assert mixed.positions.tolist() == [5, 6, 2, 0, 1]
    assert mixed.batch.slot_mapping.tolist() == [3 * BS + 5, 3 * BS + 6, 8 * BS + 2,
                                                 PAD_SLOT, PAD_SLOT]
    assert mixed.batch.seq_lens.tolist() == [7, 3]
    padded = buffers.fill([1], [1], [5], ["a"], [[3, 4]], [], BS, pad_to=4)
    assert padded.batch.slot_mapping.tolist() == [4 * BS + 1, PAD_SLOT, PAD_SLOT, PAD_SLOT]
    assert padded.batch.seq_lens.tolist() == [6, 0, 0, 0]


def test_mixed_graph_padding_adds_empty_sequences_and_trailing_tokens():
    """A mixed graph's layout: T tokens and S sequences whatever the step; the added
    sequences have no tokens and no context, the added tokens lie past the last sequence
    (attention gives them zeros) with no slot, and the logit rows keep their places."""
    buffers = StepBuffers(torch.device("cpu"), max_tokens=64, max_seqs=8, max_blocks=4)
    for qlens, starts in (([3, 1], [0, 6]), ([1, 1], [4, 6])):  # mixed, and decodes only
        t = sum(qlens)
        ids = list(range(10, 10 + t))
        rows = [t - 2, t - 1] + [0] * 4
        inputs = buffers.fill(ids, qlens, starts, ["a", "b"], [[3, 4], [5, 6]], rows, BS,
                              pad_to=6, pad_tokens=12)
        loc = [0, qlens[0], t, t, t, t, t]
        assert inputs.batch.query_start_loc.tolist() == loc
        assert inputs.batch.seq_lens.tolist() == [starts[0] + qlens[0], starts[1] + 1, 0, 0,
                                                  0, 0]
        assert inputs.input_ids.tolist() == ids + [0] * (12 - t)
        slots = inputs.batch.slot_mapping.tolist()
        assert slots[:t] == expected_slots([[3, 4], [5, 6]], starts, qlens)
        assert slots[t:] == [PAD_SLOT] * (12 - t)
        assert inputs.logit_rows.tolist() == rows
        assert inputs.batch.block_tables[2:].eq(0).all()


def test_every_region_is_16_byte_aligned_whatever_the_counts():
    """Triton compiles a kernel variant per pointer alignment (16 bytes or not): the regions
    a kernel reads start aligned for any token and sequence count, so no step compiles a
    second variant while serving."""
    buffers = StepBuffers(torch.device("cpu"), max_tokens=64, max_seqs=8, max_blocks=16)
    for s in range(1, 8):
        for extra in range(0, 6):  # prefill tokens beyond one a sequence: odd and even T
            qlens = [1] * (s - 1) + [1 + extra]
            starts = [3] * s
            ids = list(range(sum(qlens)))
            inputs = buffers.fill(ids, qlens, starts, [f"r{i}" for i in range(s)],
                                  [[i] * 2 for i in range(s)], [len(ids) - 1], BS)
            b = inputs.batch
            for name, t in [("ids", inputs.input_ids), ("positions", inputs.positions),
                            ("slot_mapping", b.slot_mapping), ("logit_rows", inputs.logit_rows),
                            ("query_start_loc", b.query_start_loc), ("seq_lens", b.seq_lens)]:
                assert t.data_ptr() % 16 == 0, (name, s, len(ids))
            assert b.seq_lens.tolist() == [4] * (s - 1) + [4 + extra]
            assert inputs.positions.tolist()[-1] == 3 + extra
