"""Publication of full weights to the inference model: bf16 before the gather, in buckets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ajet.engine.parallel.distributed import PUBLISH_BUCKET_BYTES, copy_full_weights
from ajet.engine.planning import memory_plan
from tests.support import PROJECT_ROOT


def test_one_process_copies_cast_to_the_targets_dtype_and_counts_the_bytes() -> None:
    source = nn.Linear(4, 3)
    target = nn.Linear(4, 3).to(torch.bfloat16)
    published = copy_full_weights(source, target)
    assert torch.equal(target.weight.detach(), source.weight.detach().to(torch.bfloat16))
    assert (published.tensors, published.bytes) == (2, (12 + 3) * 2)
    assert copy_full_weights(source, source).tensors == 0  # the shared model: nothing to do


def test_the_planner_counts_the_same_bucket_as_the_engine() -> None:
    assert memory_plan.PUBLISH_BUCKET_BYTES == PUBLISH_BUCKET_BYTES


@pytest.mark.slow
def test_two_ranks_gather_bf16_shards_in_buckets(tmp_path: Path) -> None:
    out = tmp_path / "pub.json"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--standalone", str(Path(__file__).with_name("publish_probe.py")),
                    str(out)], env=env, check=True, timeout=120, capture_output=True)
    found = json.loads(out.read_text())
    # 5 parameters of 42 elements; each rank sends its chunk padded to the longest one
    # (five: 3 rows of 3, one: 1 row of 4, bias: 4, cube: 2 x 4, frozen: 1 x 2)
    chunks = [9, 4, 4, 8, 2]
    for label, sends in (("alone", chunks), ("pairs", [13, 12, 2]), ("one", [27])):
        result = found[label]
        assert all(result["equal"].values()), (label, result["equal"])
        assert [c["numel"] for c in result["calls"]] == sends, label
        assert {c["dtype"] for c in result["calls"]} == {"torch.bfloat16"}  # cast first
        assert result["bytes"] == 42 * 2 and result["tensors"] == 5
    assert found["trainable_only"]["tensors"] == 4
    assert not found["trainable_only"]["frozen_equal"]  # a frozen weight is left alone
