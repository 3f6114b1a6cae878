"""One tiny model for the role tests (hidden 64, one layer), built once per session."""

import pytest

from components.tiny import TinyModelSpec, build_tiny_model

TINY_SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                          num_hidden_layers=1)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model"), TINY_SPEC))
