"""What local training needs (`Trainable`): the config with its runtime made concrete, the
model and tokenizer, the LoRA slots and the federated data.

One type for both places that train: the in-process run (`fedlora.federation.runstate.Run`
is a `Trainable` with the rest of the run on top) and a Flower node's state
(`fedlora.federation.flower.node.client_state`, one slot). Both are built by
`runstate.load_trainable`, and `fedlora.federation.trainer.train_clients` takes either.
Light to import (the heavy types are annotations only): the Flower ClientApp imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedlora.config.experiment import ExperimentConfig

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from fedlora.llm.data import FederatedData
    from fedlora.llm.lora import SlotLora


@dataclass
class Trainable:
    """The model with its LoRA slots and the data it trains on (see the module)."""

    cfg: ExperimentConfig  # model.device/dtype and evaluation.format concrete (no "auto")
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    lora: SlotLora  # `slots` client slots and the global adapter
    fed: FederatedData  # the partition, its weights a_n and the eval sets
