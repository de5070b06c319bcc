"""LoRA adapters (docs/lora.md): reading PEFT adapters, and running many of them in one batch."""
