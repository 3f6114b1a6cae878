"""What the tests of flows/runtime/weights/ share: a tiny model to publish, a rollout engine that records what
it is given, and a wait for a stored copy's commit."""

from __future__ import annotations

import time

import pytest


class RecordingEngine:
    """A rollout engine (components.protocols.RolloutRole) that records what it loads: a stored folder's path,
    or ("memory", version) for in-memory weights; it never sleeps."""

    def __init__(self, version=None):
        self.weights_version, self.loaded = version, []
        self.last_metrics, self.asleep, self.weights_path = {}, False, None

    def generate(self, prompt_ids, params):
        raise NotImplementedError

    def close(self):
        pass

    def load_weights(self, source):
        self.loaded.append(source if isinstance(source, str) else ("memory", source.version))


@pytest.fixture
def recording_engine():
    return RecordingEngine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # on use: transformers and the tiny model are slow to import for the tests that need neither
    from transformers import AutoModelForCausalLM

    from components.tiny import build_tiny_model

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture
def committed_within():
    """committed_within(folder, seconds): whether `folder`'s copy is committed within `seconds`."""
    def wait(folder, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not (folder / "_COMMITTED").exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
    return wait
