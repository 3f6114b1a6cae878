"""flows.runtime.weights.transport: the run's transport is chosen from trainer.weight_sync and
trainer.execution, under the run's folder, with its weight budget."""

from __future__ import annotations

from flows.config import build_config
from flows.runtime.weights import stored_versions
from flows.runtime.weights.in_memory import MemoryTransport
from flows.runtime.weights.on_storage import StorageTransport
from flows.runtime.weights.streamed import StreamTransport
from flows.runtime.weights.transport import transport_for, weight_sync_mode


def test_the_runs_transport_is_under_its_folder_with_its_weight_budget_and_sync_mode(tmp_path):
    def config(**trainer):
        return build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                             "trainer": {"keep_weights": 4, **trainer}})

    workers = transport_for(config(execution="workers"))  # auto: streamed from the actor's worker
    assert type(workers) is StreamTransport and workers.keep_weights == 4 and weight_sync_mode(config()) == "memory"
    assert workers.layout.run_dir == str(tmp_path / "r") and [workers.streams(v) for v in (0, 1)] == [False, True]
    assert workers.timeout_s == 3600 and workers.connect_timeout_s == 300 and workers.bucket_bytes == 512 * 2**20
    local = transport_for(config())  # auto: the rollout engine is in the actor's process
    assert type(local) is MemoryTransport and not local.streams(1)
    assert local.keep_weights == 4 and [local.stored(v) for v in (1, 2)] == [True, True]  # checkpoint_every=1
    assert type(transport_for(config(weight_sync="storage"))) is StorageTransport
    assert type(transport_for(config(weight_sync="storage", execution="workers"))) is StorageTransport
    assert type(transport_for(config(weight_sync="memory", execution="workers"))) is StreamTransport


def test_stored_versions_are_the_checkpoint_steps_and_the_last_or_all_without_a_weight_budget(tmp_path):
    def stored(**trainer):
        config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                               "trainer": {"total_steps": 7, "checkpoint_every": 3, **trainer}})
        return [version for version in range(1, 8) if stored_versions(config)(version)]

    assert stored() == [3, 6, 7]
    assert stored(checkpoint_every=0) == [7]
    assert stored(keep_weights=None) == [1, 2, 3, 4, 5, 6, 7]
