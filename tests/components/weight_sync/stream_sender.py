"""The actor's side of a weights stream in a process of its own, for tests/components/weight_sync/test_sender.py:

    python stream_sender.py MODEL CHANNEL_FILE SYNC VERSION HOLDS BUCKET_BYTES [DEVICE]

loads MODEL (float32), perturbs it as `perturb` does, opens a channel (written to CHANNEL_FILE), serves
version VERSION until the sync SYNC is done or aborted, and prints its metrics as JSON. Under torchrun
(RANK set) the model is sharded with FSDP2 over gloo ranks, as a sharded actor's worker is: every rank
serves, rank 0 talks to the channel.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from components import distributed  # noqa: E402
from components.models import load_causal_lm  # noqa: E402
from components.weight_sync.buckets import compute_tensors  # noqa: E402
from components.weight_sync.sender import WeightSender  # noqa: E402


def perturb(model: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    """A deterministic change of every weight (what an update does), the same in any process."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    return model


def main() -> None:
    model_path, channel_file, sync, version, holds, bucket_bytes = sys.argv[1:7]
    device = torch.device(sys.argv[7] if len(sys.argv) > 7 else "cpu")
    model = perturb(load_causal_lm(model_path, dtype="float32", device="cpu")).to(device)
    sharded = "RANK" in os.environ
    if sharded:
        torch.distributed.init_process_group("gloo")
        distributed._COMMANDS = torch.distributed.group.WORLD
        distributed.shard_model(model)
    writer = distributed.is_writer()
    sender = WeightSender(address="127.0.0.1")
    if writer:
        channel = sender.open().to_json()
        Path(channel_file + ".tmp").write_text(channel)
        os.replace(channel_file + ".tmp", channel_file)
    metrics = sender.serve(sync=sync, version=int(version), holds=holds == "1",
                           tensors=lambda: compute_tensors(model, torch.float32), device=device,
                           bucket_bytes=int(bucket_bytes), timeout_s=120, ack_timeout_s=30, writer=writer,
                           decide=distributed.broadcast_call if sharded else (lambda plan: plan))
    print(json.dumps({"rank": distributed.rank(), **metrics}), flush=True)


if __name__ == "__main__":
    main()
