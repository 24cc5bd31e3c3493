"""The measurements behind `bench/bench_train_memory.py`, run in fresh processes.

    python bench/train_memory_probe.py <dir> <out.json> STEPS [--quick]
    python -m torch.distributed.run --nproc_per_node=2 --standalone \\
        bench/train_memory_probe.py <dir> <out.json> state               # FSDP2, 2 gloo ranks

STEPS is a comma-separated list run in order in this process, out of `build`, `state`,
`peak-old`, `peak-new`; their results go to out.json as one object. A peak is only
meaningful first in its process (resident memory never shrinks), so `make bench` runs
each peak alone; the smoke test (`--quick`) runs them together to save start-ups.

`build` writes a Qwen2-shaped checkpoint with random weights (about 55 M parameters:
hidden 640, 8 layers, vocabulary 32k, tied embeddings) and ajet-tiny's tokenizer (the
update only needs its pad id). `state` runs one real `Learner.update` and counts the
bytes this rank holds for the trained model: parameters, gradients (as many as the
trainable parameters, at the optimizer step) and AdamW state, local shards only.
`peak` scores one long micro-batch (8 x 1k tokens) and backpropagates, and reports the
peak resident memory above what the process held before: `old` is the engine's former
path (the model's full logits, gathered and log-softmaxed in fp32, no activation
checkpointing), `new` is `scoring.ResponseScorer` (chunked logits) with activation
checkpointing.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

#: the ~50M-parameter Qwen2 shape (quick: a few hundred thousand, for the smoke test)
SHAPES = {
    False: dict(vocab_size=32_000, hidden_size=640, intermediate_size=1728,
                num_hidden_layers=8, num_attention_heads=10, num_key_value_heads=2),
    True: dict(vocab_size=2_000, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
#: rows x (prompt + response) tokens of the long micro-batch
LONG = {False: (8, 24, 1000), True: (2, 8, 56)}


def build(target: Path, *, quick: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ajet.engine.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(target.parent / "tiny-work", seed=0)
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[quick], max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=2)
    Qwen2ForCausalLM(config).save_pretrained(target)
    for name in os.listdir(tiny):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(tiny / name, target / name)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def state(model_dir: Path, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    from ajet.copilot.job import AgentJetJob
    from ajet.engine.config import engine_config_from_job
    from ajet.engine.parallel.distributed import init_distributed
    from ajet.engine.learner import Learner, TrainSample
    from ajet.engine.policy import load_policy

    torch.set_num_threads(1)
    dist = init_distributed(on_gpu=False)
    cfg = engine_config_from_job(AgentJetJob(lr=1e-4), cuda_devices=0, cpu_count=1)
    learner = Learner(load_policy(model_dir, device="cpu", dtype="float32", seed=0), cfg, dist)
    samples = [TrainSample((5, 6, 7), (8, 9), (-1.0, -1.0), 1.0 - 2 * (g % 2), group=g)
               for g in range(4)]
    learner.update(samples)

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(learner.model.scorer.parameters())
    param_bytes = sum(local_bytes(p) for p in params)
    grad_bytes = sum(local_bytes(p) for p in params if p.requires_grad)
    optim_bytes = sum(local_bytes(v) for s in learner.optimizer.state.values()
                      for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    inference = sum(local_bytes(p) for p in learner.policy.model.parameters())
    shared = learner.policy.model is learner.model.hf_model  # one process: no copy
    result = {"rank": dist.rank, "world_size": dist.world_size, "parameters": param_bytes,
              "gradients": grad_bytes, "optimizer": optim_bytes,
              "inference_copy": 0 if shared else inference,
              "numel": sum(p.numel() for p in learner.policy.model.parameters())}
    results = dist.gather(result)
    if dist.is_main:
        out.write_text(json.dumps(results))


def peak(model_dir: Path, out: Path, path: str, *, quick: bool) -> None:
    from ajet.engine.scoring import ResponseScorer, pack_responses
    from ajet.engine.parallel.training_model import load_causal_lm

    torch.set_num_threads(1)
    lm = load_causal_lm(model_dir, dtype=torch.float32, device="cpu")
    lm.train()
    rows, prompt_len, response_len = LONG[quick]
    gen = torch.Generator().manual_seed(0)
    vocab = lm.config.vocab_size
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    responses = [torch.randint(3, vocab, (response_len,), generator=gen).tolist()
                 for _ in range(rows)]
    batch = pack_responses(prompts, responses, pad_id=0, device=torch.device("cpu"))
    if path == "new":
        from ajet.engine.parallel.training_model import enable_activation_checkpointing

        enable_activation_checkpointing(lm)
        scorer = ResponseScorer(lm, chunk_tokens=1024)
    before = _rss_mb()
    if path == "new":
        logprobs, _ = scorer(batch)
    else:  # the former score_responses: whole logits, gathered (B, R, V), fp32 softmax
        logits = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    use_cache=False).logits
        index = batch.gather_at.unsqueeze(-1).expand(-1, -1, logits.size(-1))  # (B, R, V)
        logp_all = F.log_softmax(logits.gather(1, index).float(), dim=-1)  # (B, R, V)
        logprobs = logp_all.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1) * batch.mask
        with torch.no_grad():
            (-(logp_all.exp() * logp_all).sum(-1) * batch.mask).sum()
    (-(logprobs.sum()) / batch.mask.sum()).backward()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out.write_text(json.dumps({"path": path, "peak_above_start_mb": peak_mb - before,
                               "tokens": rows * (prompt_len + response_len)}))


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    model_dir, out, steps = (a for a in argv if a != "--quick")
    results: dict[str, object] = {}
    scratch = Path(out).with_suffix(".step.json")
    for step in steps.split(","):
        if step == "build":
            build(Path(model_dir), quick=quick)
            continue
        if step == "state":
            state(Path(model_dir), scratch)
        elif step in ("peak-old", "peak-new"):
            peak(Path(model_dir), scratch, step.removeprefix("peak-"), quick=quick)
        else:
            raise SystemExit(f"unknown step {step!r}: build, state, peak-old or peak-new")
        if scratch.exists():  # state() writes only on rank 0
            results[step] = json.loads(scratch.read_text())
    if results:
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's teardown, as the engine does
