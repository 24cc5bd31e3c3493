"""KV cache sizing (`ajet/engine/generation/kv_cache.py`): plain arithmetic, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ajet.engine.generation.kv_cache import (
    GPU_MAX_BATCH_TOKENS,
    CacheTooSmall,
    ModelGeometry,
    plan_cpu_cache,
    plan_gpu_cache,
)
from tests.support import PROJECT_ROOT

TINY = ModelGeometry(layers=2, kv_heads=2, head_dim=16)
GiB = 1024**3
#: Qwen2.5-7B-Instruct's config.json, the fields the plan reads
QWEN_7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "hidden_size": 3584}


def test_geometry_from_a_config_json_dict_or_nested_text_config() -> None:
    geometry = ModelGeometry.from_config(QWEN_7B)
    assert geometry == ModelGeometry(layers=28, kv_heads=4, head_dim=128)
    assert geometry.kv_bytes_per_token(2) == 57_344  # 56 KiB per token in bf16
    assert ModelGeometry.from_config({"text_config": QWEN_7B}) == geometry


def test_cpu_cache_holds_the_concurrent_requests_within_its_budget() -> None:
    plan = plan_cpu_cache(TINY, dtype_bytes=4, max_request_tokens=288, concurrency=32,
                          budget_mb=64, max_batch_tokens=256)
    assert plan.tokens == 32 * 9 * 32  # 288 tokens = 9 pages of 32, for each of 32 requests
    assert plan.max_batch_tokens == 256 and plan.max_memory_percent is None
    capped = plan_cpu_cache(TINY, dtype_bytes=4, max_request_tokens=4096, concurrency=64,
                            budget_mb=8, max_batch_tokens=256)
    per_token = 256 + 256 * 4 + 8  # KV + mask column + read index
    assert capped.tokens is not None and capped.tokens * per_token <= 8 * 1024**2
    floor = plan_cpu_cache(TINY, dtype_bytes=4, max_request_tokens=4096, concurrency=64,
                           budget_mb=0.1, max_batch_tokens=256)
    assert floor.tokens == 4096  # never less than one longest request
    assert "KV cache on cpu: 4096 tokens" in floor.summary()


def test_gpu_cache_gets_what_the_utilisation_leaves() -> None:
    geometry = ModelGeometry.from_config(QWEN_7B)
    # 80 GB GPU, 30 GiB already taken: 0.85 * 80 - 30 = 38 GiB for the cache
    plan = plan_gpu_cache(geometry, dtype_bytes=2, max_request_tokens=18_000, concurrency=128,
                          total_bytes=80 * GiB, free_bytes=50 * GiB,
                          gpu_memory_utilization=0.85)
    assert plan.budget_bytes == int(0.85 * 80 * GiB) - 30 * GiB
    assert plan.max_memory_percent == pytest.approx(38 / 50)
    assert plan.num_blocks is None  # 128 long requests want more: transformers fills it
    small = plan_gpu_cache(geometry, dtype_bytes=2, max_request_tokens=1000, concurrency=8,
                           total_bytes=80 * GiB, free_bytes=50 * GiB,
                           gpu_memory_utilization=0.85)
    assert small.num_blocks == 8 * 4  # 1000 tokens = 4 pages of 256, for each of 8
    # a capped cache names its batch size too: left open, transformers 5.17 solves it to
    # fill the budget with attention masks and logits the planner never counted
    assert small.max_batch_tokens == GPU_MAX_BATCH_TOKENS
    assert plan.max_batch_tokens is None  # uncapped: transformers' default, then the blocks
    with pytest.raises(CacheTooSmall) as refused:
        plan_gpu_cache(geometry, dtype_bytes=2, max_request_tokens=18_000, concurrency=1,
                       total_bytes=80 * GiB, free_bytes=13 * GiB,
                       gpu_memory_utilization=0.85)
    message = str(refused.value)
    assert "gpu_memory_utilization=0.85" in message and "67.00 GiB is in use" in message
    assert "raise gpu_memory_utilization" in message


def test_the_plan_imports_no_torch() -> None:
    code = ("import sys, json; import ajet.engine.generation.kv_cache, ajet.engine.generation.interface; "
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, check=True,
                         capture_output=True, text=True)
    assert json.loads(out.stdout) == []
