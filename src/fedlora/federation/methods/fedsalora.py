"""`fedsalora`: FedSA-LoRA, share A and keep B on the client (Guo et al., ICLR 2025).

FedSA-LoRA's finding: the A matrices learn what the clients share, the B matrices what is
specific to each. Each round m clients are sampled uniformly (``method.clients_per_round``;
0 = all); client n trains both factors, starting from the global A and ITS OWN B_n (the one
it kept after the last round it took part in; at first the init, B = 0), uploads only A_n
and keeps B_n. The server averages

    A ← Σ_{n∈K} p_n A_n,   p_n = a_n / Σ_{m∈K} a_m,

and never sees a B (`is_local`: the trainer strips every ``lora_B`` from the upload and keeps
it in the client's memory, `fedlora.federation.clientmemory`). Client n's model is the
personalised (A, B_n).

Evaluation: FedSA-LoRA evaluates each client's personalised model on its own test data;
fedlora evaluates one global adapter on the task's test set. That adapter is (A, B̄) with
B̄ = Σ_n a_n B_n over every client's kept B (a client that never trained: its init 0). B̄ is
formed in the simulation for evaluation and export only: it is sent on no link and the clock
does not count it.

Payload per participant: A of every LoRA module, γ·in parameters, up and down.
"""

from __future__ import annotations

from fedlora.federation.methods.partial import PartialMethod
from fedlora.federation.methods.registry import register_method


@register_method("fedsalora")
class FedSALoRA(PartialMethod):
    name = "fedsalora"
    dp_refusal = (
        "its clients keep B on the device and the evaluated adapter uses their "
        "mean, released without noise"
    )
    flower_refusal = (
        "each client's own B is kept by the engine's client memory, and evaluating one "
        "global adapter needs every client's B, which FedSA-LoRA never sends; use "
        "`fedlora run`"
    )
    trains = "AB"
    averages = uplink = downlink = "A"
    delta_aggregate = True  # A ← A + Σ p_n (A_n − A)

    def is_local(self, name: str) -> bool:
        return name.endswith(".lora_B")
