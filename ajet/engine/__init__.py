"""The AgentJet training engine: run as `python -m ajet.engine` by the swarm server.

This package is the only place that imports torch and transformers, and only in its
submodules (`memory_plan`, `config` and `tiny` import neither): importing `ajet.engine`
itself stays light, so `python -m ajet.engine` can fix `sys.path` (the active snapshot
first) before anything heavy is loaded.

Modules, one noun each (read in this order):

    config.py       AgentJetJob -> EngineConfig, backend defaults
    tiny.py         the built-in `ajet-tiny` checkpoint, built locally
    policy.py       load a checkpoint; chat template; sampling
    scoring.py      response-token log-probs and entropy, logits in chunks
    inference.py    the generation interface (Generator, GenerationRequest, ...)
    continuous_batching.py  its backend: KV cache + continuous batching (transformers)
    kv_cache.py     KV cache sizing from the job and the memory available
    recompute.py    the reference generator without a cache (bench, fallback)
    ranks.py        every rank generates: rank 0 routes episodes, the others serve
    trajectory.py   what an episode recorded (token ids and sampling log-probs)
    episodes.py     episode registry: claims, timeouts, per-task groups
    chat_api.py     the private channel's routes (status, episodes, chat completions)
    channel.py      uvicorn on the private Unix socket
    rewards.py      reward processing
    advantages.py   GRPO advantages
    loss.py         clipped policy-gradient loss with optional KL
    training_model.py  the trained model: fp32 masters, LoRA, checkpointing, FSDP2,
                    and publishing its weights to the inference model
    lora.py         LoRA adapters through peft
    learner.py      optimizer and the update over ppo_epochs and mini-batches
    metrics.py      metrics.jsonl
    memory_plan.py  the memory planner: per-GPU estimate from config.json (no torch),
                    run at config time by ajet/copilot/validate.py and logged at boot
    peak_memory.py  the measured peak memory on each metrics line
    checkpoints.py  Hugging Face checkpoint directories and the sharded training state
    trainer.py      the step loop (ROLLING -> ROLLING_POST -> WEIGHT_SYNCING)
    distributed.py  several processes under torchrun: rank 0, FSDP2, the collectives
    runtime.py      process assembly: boot, serve, signals, shutdown
"""

__all__: list[str] = []
