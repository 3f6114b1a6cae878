"""components.protocols.RolloutRole names everything the runtime uses on a rollout engine, and every engine
registered in flows.training.engines.ROLLOUT_ENGINES provides all of it; an unknown engine name is refused
with one line naming the field, the value and the valid names."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from types import SimpleNamespace

import pytest

from components.protocols import ROLLOUT_MEMBERS, RolloutRole
from components.rollout import HFRolloutEngine, RolloutConfig
from components.vllm_data_parallel import DataParallelRollout
from flows.config import build_config
from flows.training.engines import ROLLOUT_ENGINES, build_rollout_engine, rollout_engine, rollout_engine_name

REGISTERED = sorted({cls for spec in ROLLOUT_ENGINES.values() for cls in spec.classes}, key=lambda cls: cls.__name__)


def _declares(cls: type, name: str) -> bool:
    """A method or property on the class, or an attribute it declares (annotated in its body)."""
    return hasattr(cls, name) or any(name in vars(base).get("__annotations__", {}) for base in cls.__mro__)


def test_the_protocol_lists_and_documents_the_members_the_runtime_uses():
    assert ROLLOUT_MEMBERS == ("weights_version", "last_metrics", "asleep", "weights_path",
                               "generate", "load_weights", "close")
    body = ast.parse(textwrap.dedent(inspect.getsource(RolloutRole))).body[0].body
    documented = {node.name for node in body if isinstance(node, ast.FunctionDef) and ast.get_docstring(node)}
    documented |= {node.target.id for node, following in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
                   and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)}
    assert documented == set(ROLLOUT_MEMBERS)


@pytest.mark.parametrize("cls", REGISTERED, ids=lambda cls: cls.__name__)
def test_every_registered_engine_class_provides_every_protocol_member(cls):
    missing = [name for name in ROLLOUT_MEMBERS if not _declares(cls, name)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name in ("generate", "load_weights", "close"):
        assert callable(getattr(cls, name)), name


def test_engine_instances_satisfy_the_protocol(model_path):
    engine = HFRolloutEngine.from_pretrained(model_path)
    assert isinstance(engine, RolloutRole)
    assert (engine.weights_version, engine.last_metrics, engine.asleep, engine.weights_path) == (None, {}, False,
                                                                                                 model_path)
    engine.close()

    class _Engine:  # what DataParallelRollout reads of each vLLM engine it holds
        tokenizer, start_seconds, asleep, sleep_enabled, weights_path, last_metrics = None, 1.0, False, False, "p", {}

    assert isinstance(DataParallelRollout([_Engine(), _Engine()]), RolloutRole)


def test_the_config_offers_exactly_the_registered_engines():
    choices = typing.get_args(RolloutConfig.model_fields["engine"].annotation)
    assert choices == ("auto", *ROLLOUT_ENGINES)


def test_an_unknown_engine_is_one_line_naming_the_field_the_value_and_the_choices():
    with pytest.raises(ValueError) as raised:
        rollout_engine("sglang")
    assert str(raised.value) == "rollout.engine='sglang': not a rollout engine; use auto or one of vllm, hf"
    # The config refuses it first (its choices are a Literal of the registered names); the registry refuses
    # it too where a config was made without validation.
    with pytest.raises(ValueError, match=r"^rollout.engine='sglang': Input should be 'auto', 'vllm' or 'hf'$"):
        build_config({}, ["rollout.engine=sglang"])
    config = SimpleNamespace(rollout=SimpleNamespace(engine="sglang"), trainer=SimpleNamespace(device="cpu"))
    with pytest.raises(ValueError, match=r"^rollout.engine='sglang': not a rollout engine; use auto or one of vllm, hf$"):
        rollout_engine_name(config, "cpu")


def test_auto_takes_the_first_registered_engine_that_runs_on_the_device(monkeypatch):
    config = build_config({})
    for device in ("cpu", "cuda"):
        monkeypatch.setitem(ROLLOUT_ENGINES, "vllm", dataclasses.replace(ROLLOUT_ENGINES["vllm"],
                                                                         runs_on=lambda where: where == "cuda"))
        assert rollout_engine_name(config, device) == ("vllm" if device == "cuda" else "hf")


def test_the_registry_builds_the_engine_the_config_names(model_path):
    config = build_config({"model": {"path": model_path}, "trainer": {"device": "cpu"},
                           "rollout": {"engine": "hf", "micro_batch_size": 4}})
    engine = build_rollout_engine(config, model_path, tokenizer=None)  # hf reads the policy folder's tokenizer
    assert type(engine) is HFRolloutEngine and engine.micro_batch_size == 4 and engine.weights_path == model_path
    assert ROLLOUT_ENGINES["vllm"].preloads == ("vllm",) and ROLLOUT_ENGINES["hf"].preloads == ()
