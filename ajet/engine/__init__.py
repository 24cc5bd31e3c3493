"""The AgentJet training engine: run as `python -m ajet.engine` by the swarm server.

This package is the only place that imports torch and transformers, and only in its
submodules (`planning.memory_plan`, `config` and `tiny` import neither): importing
`ajet.engine` itself stays light, so `python -m ajet.engine` can fix `sys.path` (the
active snapshot first) before anything heavy is loaded.

At the top, the step loop and what a researcher patches (read in this order):

    trainer.py      the step loop (ROLLING -> ROLLING_POST -> WEIGHT_SYNCING)
    rewards.py      reward processing
    advantages.py   GRPO advantages
    loss.py         clipped policy-gradient loss with optional KL
    learner.py      optimizer and the update over ppo_epochs and mini-batches
    scoring.py      response-token log-probs and entropy, logits in chunks
    trajectory.py   what an episode recorded, and its timelines: the training samples
    config.py       AgentJetJob -> EngineConfig, backend defaults
    checkpoints.py  Hugging Face checkpoint directories and the sharded training state
    metrics.py      metrics.jsonl
    policy.py       load a checkpoint; chat template; sampling
    tiny.py         the built-in `ajet-tiny` checkpoint, built locally
    runtime.py      process assembly: boot, serve, signals, shutdown

The machinery, one room each:

    plane/       the episode plane: the private app, episodes, the OpenAI-style routes
    generation/  the generator interface, its backends, KV cache sizing, rank routing
    planning/    the memory planner and the measured peak memory
    parallel/    torch.distributed, FSDP2, the trained model, LoRA
    transport/   uvicorn on a Unix socket, for the plane and the ranks
"""

__all__: list[str] = []
