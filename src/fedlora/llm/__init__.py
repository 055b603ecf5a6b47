"""The torch side: models, LoRA slots, local training, data and evaluation.
May import fedlora.system, never fedlora.federation or fedlora.studies. See docs/architecture.md."""
