"""fedlora: federated LoRA fine-tuning over heterogeneous wireless networks."""

__version__ = "0.1.0"
