"""The original AgentJet surface, in one room: what its scripts import and its client sends.

    client.py           SwarmClient: the typed `ajet.client.SwarmClient` plus the
                        original's methods (`get_engine_status`, `begin_episode`, ...),
                        and RetryPolicy, the back-offs of their waits
    rollouts.py         run_episodes_until_all_complete, auto_train_with_dataset
    thread_executors.py PeriodicDrainThreadPoolExecutor, BoundedThreadPoolExecutor
    task.py             Task, WorkflowOutput
    openai_endpoint.py  OpenaiBaseUrlAndApiKey, what begin_episode hands a workflow
    wire.py             the original's request and reply bodies (SwarmThrottlePolicy, ...)
    boundary.py         the conversions: original bodies and workflow outputs <-> this
                        project's models (the only module of the room the core reaches)
    nested_config.py    the original's nested `ajet:` YAML <-> the job's fields
    task_readers.py     RouterTaskReader over local_readers.py
    reader_config.py    AjetTaskReader and the other task-reader config classes

The original's module paths (`ajet.tuner_lib.experimental.swarm_client`,
`ajet.schema.task`, `ajet.task_reader`, ...) re-export from here. The room depends on the
core; the core never imports it, except three named boundary modules that reach only
`boundary` and `nested_config` (docs/compat.md, "Compatibility room";
tests/test_structure.py checks it). Nothing is imported here, so that a boundary import
stays light.
"""
