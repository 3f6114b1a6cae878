"""How the actor's weights reach the rollout engine, apart from the batches (flows/runtime/batches.py).

- `transport.py`: the protocol (`Transport`: publish, sync, send, withdraw, flush, committed copy) and the
  run's choice of one (`transport_for`, from `trainer.weight_sync` and `trainer.execution`);
- `on_storage.py`: `StorageTransport`, every policy a committed folder `weights/actor/<k>`;
- `in_memory.py`: `MemoryTransport`, the live model to an engine of the actor's process;
- `streamed.py`: `StreamTransport`, from the actor's worker to the rollout's;
- `stored_copy.py`: the stored copy the memory paths write in the background, for recovery and export;
- `handover.py`: the driver's pairing of a stage declared `needs_policy_weights` with the actor's sender.

The parts that move the tensors (buckets, channel, sender, receiver, the vLLM worker extension) are
components/weight_sync/; nothing here holds a model.
"""

from flows.runtime.weights.handover import HandOvers, changes_policy_weights, needs_policy_weights
from flows.runtime.weights.transport import Transport, stored_versions, transport_for, weight_sync_mode

__all__ = ["HandOvers", "Transport", "changes_policy_weights", "needs_policy_weights", "stored_versions",
           "transport_for", "weight_sync_mode"]
