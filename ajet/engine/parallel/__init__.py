"""Training across processes: torch.distributed, FSDP2, the trained model, LoRA.

    distributed.py    who is rank 0, the process groups and the few collectives
    training_model.py precision, LoRA, activation checkpointing, FSDP2, weight publication
    lora.py           LoRA adapters through peft
"""
