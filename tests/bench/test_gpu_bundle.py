"""The GPU bundle and the end-to-end report: what is bundled, and what fails a run."""

from __future__ import annotations

from bench.gpu_bundle import HOST_PROVIDED, bundle_requirements, requirement_name
from bench.gpu_e2e import hbm_floor, problems
from bench.gpu_model import QWEN25_VOCAB_SIZE, filler_vocab


def test_bundle_holds_the_server_extra_and_build_tools_but_not_the_torch_stack() -> None:
    names = {requirement_name(r) for r in bundle_requirements()}
    assert {"fastapi", "uvicorn", "httpx", "pydantic", "pyyaml", "gitpython", "jinja2",
            "pydantic-settings", "python-multipart", "setuptools", "wheel"} <= names
    assert not names & set(HOST_PROVIDED)


def test_synthetic_tokenizer_has_qwen25_vocabulary_size() -> None:
    vocab = filler_vocab(QWEN25_VOCAB_SIZE)
    assert len(vocab) == QWEN25_VOCAB_SIZE
    assert sorted(vocab.values()) == list(range(QWEN25_VOCAB_SIZE))
    assert vocab["<|im_end|>"] == 2


def _report(**over: object) -> dict:
    ok = {"errors": [], "completed": 3, "concurrency": 1}
    report = {"single": dict(ok), "concurrent": dict(ok, concurrency=64), "steps_wanted": 2,
              "metrics": [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}],
              "concurrent_wall_s": 10.0, "last_error": None}
    report.update(over)
    return report


def test_a_clean_run_has_no_problems_and_each_failure_is_named() -> None:
    assert problems(_report()) == []
    nan = problems(_report(metrics=[{"step": 1, "loss": float("nan")}, {"step": 2}]))
    assert any("loss is nan" in p for p in nan)
    stalled = problems(_report(metrics=[{"step": 1}]))
    assert any("only 1 of 2 steps" in p for p in stalled)
    failed = problems(_report(concurrent={"errors": ["HTTP 500"], "completed": 0}))
    assert any("request error" in p for p in failed) and any("no request" in p for p in failed)


def test_hbm_floor_of_a_half_billion_parameter_model() -> None:
    floor = hbm_floor(494_000_000)
    assert abs(floor["weights_gb"] - 0.988) < 1e-3
    assert 4000 < floor["tokens_per_s_ceiling_one_request"] < 6000
