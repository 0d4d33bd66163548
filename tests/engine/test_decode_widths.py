"""Split-KV decode work follows the step's longest context, not the block-table width (issue #21 item 4).

Read from the launch plan (tokenbus_kernels/decode_attention.plan_decode as a 132-SM GPU gets it) on the CPU: a padded
decode step cuts its tables to DecodeWidths' bucket, so at batch 256, context ~1k and max_model_len 32k at most
10 % of the stage-1 programs exit at once (94-97 % with the full-width table)."""

from __future__ import annotations

import pytest

from benchmarks.kernels.decode_partitions import H200_SMS, graph_count, idle_share
from tokenbus_kernels.partitions import cdiv, idle_programs, num_partitions
from worker.engine.cuda_graphs import DecodeWidths, decode_buckets


@pytest.mark.parametrize("context", [1000, 1024, 1025, 1090])
def test_batch_256_at_1k_of_32k_launches_at_most_10_percent_idle(context):
    before, parts_before = idle_share(256, context, 32768, cut=False)
    after, parts_after = idle_share(256, context, 32768, cut=True)
    assert before >= 0.9 and parts_before == 32
    assert after <= 0.10, (after, parts_after)


def test_every_uniform_batch_wastes_under_half_and_every_table_fits():
    widths = DecodeWidths(2048, 16, 3, H200_SMS)  # max_model_len 32k, block 16, SmolLM2's 3 kv heads
    for b in decode_buckets(256):
        ladder = widths.for_bucket(b)
        assert ladder == sorted(set(ladder)) and ladder[-1] == 2048
        parts = [num_partitions(w * 16, b, 3, H200_SMS) for w in ladder]
        assert parts.count(1) <= 1  # widths of one partition share one graph
        for context in range(1, 32769, 61):
            w = widths.pick(b, cdiv(context, 16))
            assert w >= cdiv(context, 16)
            idle, launched = idle_programs([context] * b, w * 16, 3, H200_SMS)
            assert idle < launched / 2, (b, context, w, idle, launched)


def test_graph_shapes_stay_logarithmic_in_max_model_len():
    # 15 row buckets at max_num_seqs 256; a width ladder doubling from one minimal partition
    assert graph_count(256, 2048) <= 15 * 5
    assert graph_count(256, 32768) <= 15 * 9
    assert graph_count(256, 131072) <= 15 * 11
