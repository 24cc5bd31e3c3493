"""Several engine processes under torchrun (gloo on CPU), launched by a real swarm server."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict
from ajet.protocol import EngineState
from swarm_server.engine import engine_command
from swarm_server.settings import Settings
from tests.support import PROJECT_ROOT, free_port, make_ajet_repo, process_alive, start_server

JOB = dict(batch_size=1, num_repeat=4, max_new_tokens=8, lr=0.01, seed=3)


def test_engine_command_wraps_multi_process_jobs_in_torchrun(tmp_path: Path) -> None:
    settings = Settings(workdir=tmp_path)
    kwargs: dict[str, Any] = {"run_id": "r", "run_dir": tmp_path, "socket_path": tmp_path / "s"}
    single = engine_command(settings, **kwargs, job={"n_gpu": 0, "n_proc": 1})
    assert single[1:3] == ["-m", "ajet.engine"]
    cpu = engine_command(settings, **kwargs, job={"n_gpu": 0, "n_proc": 2})
    assert cpu[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cpu and "--standalone" in cpu
    assert cpu[cpu.index("--config") - 2:cpu.index("--config")] == ["-m", "ajet.engine"]
    gpu = engine_command(settings, **kwargs, job={"n_gpu": 8, "n_proc": 1, "nnodes": 2,
                                                  "node_rank": 1,
                                                  "rdzv_endpoint": "10.0.0.1:29500"})
    assert "--nproc_per_node=8" in gpu and "--nnodes=2" in gpu and "--node_rank=1" in gpu
    assert "--master_addr=10.0.0.1" in gpu and "--master_port=29500" in gpu


def test_with_nccl_configured_every_control_message_goes_over_the_cpu_group(
        tmp_path: Path) -> None:
    """Two processes, the default group torch's fake one where NCCL was asked for
    (`control_probe.py`): the commands still arrive, so they crossed on the gloo group."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    probe = str(Path(__file__).with_name("control_probe.py"))
    ranks = [subprocess.Popen([sys.executable, probe, str(tmp_path / f"rank{r}.json")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for found in (zero, one):
        # NCCL (here: fake) for tensors, with the 30-minute default and async error
        # handling; one gloo group with the long timeout for control, one for the
        # background checkpoint writes with the tensor timeout
        assert found["asked"] == {"backend": "nccl", "timeout_s": 1800.0}
        assert found["default_backend"] == "fake" and found["device_type"] == "cuda"
        assert found["groups"] == [{"backend": "gloo", "timeout_s": 86400.0},
                                   {"backend": "gloo", "timeout_s": 1800.0}]
        assert found["control_backend"] == "gloo"
        assert found["async_error_handling"] == "3"
        assert found["gathered"] == [[0, "endpoint-0"], [1, "endpoint-1"]]
        assert found["max_int"] == 6 and found["sum_floats"] == [3.0, 1.0]
    # the follower's command loop got both batches and the stop
    assert one["steps"] == 2 and one["batches"] == [[[3], [5, 6]], [[3]]]


#: torch.distributed calls that carry control messages (objects and scalars): each must
#: name its group, and in the engine that group is the CPU one (`Dist.control`).
_CONTROL_CALLS = {"broadcast_object_list", "all_gather_object", "gather_object",
                  "scatter_object_list", "send_object_list", "recv_object_list",
                  "all_reduce", "broadcast", "barrier", "monitored_barrier"}


def test_no_control_collective_in_the_engine_runs_on_the_default_group() -> None:
    """Every object or scalar collective the engine issues names the control group."""
    import ast

    found = []
    for path in sorted((PROJECT_ROOT / "ajet").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _CONTROL_CALLS):
                continue
            owner = ast.unparse(node.func.value)
            if owner not in ("torch_dist", "torch.distributed", "dist_c10d"):
                continue
            group = next((k.value for k in node.keywords if k.arg == "group"), None)
            found.append((path.relative_to(PROJECT_ROOT).as_posix(), node.func.attr,
                          ast.unparse(group) if group is not None else None))
    assert found, "no collective found: the scan is looking in the wrong place"
    # a tensor collective names the tensor group, and only in distributed.py
    tensor_ok = {("ajet/engine/parallel/distributed.py", "torch_dist.group.WORLD")}
    assert {(f, call) for f, call, group in found
            if group != "self.control" and (f, group) not in tensor_ok} == set(), found


def _episodes(client: SwarmClient, n: int) -> None:
    """n sequential episodes of one task (one worker)."""
    import openai

    done = 0
    while done < n:
        try:
            ep = client.open_episode()
        except EngineStateConflict:
            time.sleep(0.05)
            continue
        reply = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.openai_api_key,
                              max_retries=0).chat.completions.create(
            model="ajet-tiny", messages=[{"role": "user", "content": "digits"}])
        text = reply.choices[0].message.content or ""
        share = sum(c.isdigit() for c in text) / len(text) if text else 0.0
        client.report_episode(ep.episode_uuid, "one-task", share)
        done += 1


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """`fsdp_probe.py` in one process and on two gloo ranks (FSDP2), same batches."""
    tmp = tmp_path_factory.mktemp("fsdp")
    probe = str(Path(__file__).with_name("fsdp_probe.py"))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "HF_HUB_OFFLINE": "1"}
    one, two = tmp / "one.pt", tmp / "two.pt"
    subprocess.run([sys.executable, probe, str(tmp), str(one)], env=env, check=True,
                   timeout=120)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--standalone", probe, str(tmp), str(two)], env=env, check=True,
                   timeout=180)
    return torch.load(one, weights_only=False), torch.load(two, weights_only=False)


@pytest.mark.slow
def test_uneven_groups_over_two_fsdp_ranks_train_to_the_one_process_parameters(
        probe_results: tuple[dict, dict]) -> None:
    for job in ("full", "lora"):
        a, b = (r[job] for r in probe_results)
        assert a["parameters"].shape == b["parameters"].shape
        # float rounding only: the sums are taken in another order, and three AdamW steps
        # with every token's ratio clipped magnify it (the loss agrees to 1e-6)
        assert (a["parameters"] - b["parameters"]).abs().max().item() < 5e-4, job
        for x, y in zip(a["stats"], b["stats"], strict=True):
            assert x["tokens"] == y["tokens"] and x["samples"] == y["samples"] == 10
            assert x["grad_norm"] > 0
            for key in ("loss", "kl", "entropy", "clip_frac", "grad_norm"):
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (job, key)
    # a restored training state (weights and AdamW moments) takes the very same step
    for result in probe_results:
        full = result["full"]
        assert torch.equal(full["resumed_parameters"], full["parameters"])
        assert full["resumed_stats"]["loss"] == pytest.approx(full["stats"][2]["loss"],
                                                              abs=1e-6)


@pytest.mark.slow
def test_a_full_checkpoint_gathered_from_the_shards_loads_with_from_pretrained(
        probe_results: tuple[dict, dict]) -> None:
    from transformers import AutoModelForCausalLM

    full = probe_results[1]["full"]
    files = {p.name for p in full["checkpoint"].iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_state"} <= files
    loaded = AutoModelForCausalLM.from_pretrained(full["checkpoint"])
    flat = torch.cat([p.detach().flatten() for p in loaded.parameters()])
    assert torch.equal(flat, full["checkpoint_parameters"])
    assert loaded.config.architectures == ["Qwen2ForCausalLM"]


@pytest.mark.slow
def test_lora_trains_only_the_adapters_and_saves_adapter_and_merged_model(
        probe_results: tuple[dict, dict]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for result in probe_results:
        lora = result["lora"]
        assert lora["changed"] and all(".lora_" in name for name in lora["changed"])
        # rank 4 on the 7 linear layers of 2 decoder layers, out of ~0.13 M parameters
        assert lora["trainable"] == sum(t.numel() for t in lora["adapters"].values()) < 12_000
    lora = probe_results[1]["lora"]
    files = {p.name for p in lora["checkpoint"].iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "merged"} <= files
    assert "model.safetensors" not in files  # the adapter, not another copy of the base
    with_adapter = AutoModelForCausalLM.from_pretrained(lora["checkpoint"])
    assert isinstance(with_adapter, PeftModel) or hasattr(with_adapter, "peft_config")
    merged = AutoModelForCausalLM.from_pretrained(lora["checkpoint"] / "merged")
    ids = torch.tensor([[5, 9, 12, 40, 7]])
    with torch.no_grad():
        a = with_adapter(input_ids=ids).logits
        b = merged(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_two_gloo_ranks_train_then_a_killed_rank_brings_the_engine_offline_with_its_error(
        tmp_path: Path) -> None:
    """FSDP2 over two gloo ranks under the local launcher: a step trains on the episodes
    both ranks served; then rank 1 is killed. The update is checked against one process
    by `test_uneven_groups_over_two_fsdp_ranks_train_to_the_one_process_parameters`, and
    the per-rank generation counts of a clean stop by the Ray launcher's two-node test
    (tests/swarm_server/test_ray_launcher.py), where the same ranks run under torchrun."""
    server = start_server(tmp_path / "swarm")
    try:
        with SwarmClient(server.url, timeout=60) as client:
            status = client.configure_and_start(
                AgentJetJob(n_proc=2, **JOB), wait_timeout=180)
            assert status.pid is not None
            assert status.ajet_file == str(PROJECT_ROOT / "ajet" / "__init__.py")
            ranks = _children(status.pid)
            assert len(ranks) == 2
            _episodes(client, JOB["num_repeat"])
            deadline = time.monotonic() + 60
            while not (points := client.get_metrics().points):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert math.isfinite(points[0]["loss"]) and points[0]["episodes"] == JOB["num_repeat"]
            victim = max(ranks)  # the later-started child: rank 1
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while (now := client.engine_status()).state != EngineState.OFFLINE:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert now.last_error is not None
            tail = "\n".join(now.last_error.log_tail)
            assert f"pid: {victim}" in tail and "SIGKILL" in tail
            deadline = time.monotonic() + 30
            while any(process_alive(p) for p in [status.pid, *ranks]):
                assert time.monotonic() < deadline, "a process of the engine tree survived"
                time.sleep(0.1)
    finally:
        server.stop()


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_the_run_within_a_minute_naming_it(
        tmp_path: Path) -> None:
    """A synced snapshot whose loss raises on rank 1 only, at its first update."""
    repo = make_ajet_repo(tmp_path / "repo")
    loss = repo / "ajet" / "engine" / "loss.py"
    assert "def policy_loss(" in loss.read_text(), "loss.py changed shape; update this test"
    with open(loss, "a") as f:  # the learner imports the name after this module ran
        f.write("\n\n_policy_loss = policy_loss\n\n\n"
                "def policy_loss(*args, **kwargs):  # type: ignore[no-redef]\n"
                "    import os\n"
                "    if os.environ.get('RANK') == '1':\n"
                "        raise RuntimeError('loss exploded on rank 1 (test)')\n"
                "    return _policy_loss(*args, **kwargs)\n")
    server = start_server(tmp_path / "swarm")
    try:
        with SwarmClient(server.url, timeout=60) as client:
            client.push_code(repo)
            status = client.configure_and_start(AgentJetJob(n_proc=2, **JOB), wait_timeout=180)
            assert status.pid is not None
            ranks = _children(status.pid)
            _episodes(client, JOB["num_repeat"])  # one group: the first update begins
            deadline = time.monotonic() + 60
            while (now := client.engine_status()).state != EngineState.OFFLINE:
                assert time.monotonic() < deadline, "the run outlived its failed rank"
                time.sleep(0.1)
            assert now.last_error is not None
            assert ("rank 1 of 2 failed: RuntimeError: loss exploded on rank 1 (test)"
                    in now.last_error.reason), now.last_error.reason
            tail = "\n".join(now.last_error.log_tail)
            assert "[rank 1]" in tail and "loss exploded on rank 1" in tail
            deadline = time.monotonic() + 10
            while any(process_alive(p) for p in [status.pid, *ranks]):
                assert time.monotonic() < deadline, "a process of the engine tree survived"
                time.sleep(0.1)
            assert client.get_run("current").status == "failed"
    finally:
        server.stop()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)
