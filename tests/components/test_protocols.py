"""Each role class satisfies the Protocol the stages rely on."""

from components.actor import Actor
from components.critic import Critic
from components.protocols import PolicyRole, ReferenceRole, RewardModelRole, RolloutRole, ValueRole
from components.reference import Reference
from components.rewards import RewardModel
from components.rollout import HFRolloutEngine


def _instance(cls):
    return cls.__new__(cls)  # no model needed: runtime_checkable checks the methods only


def test_roles_implement_their_protocols():
    engine = _instance(HFRolloutEngine)
    engine.weights_version, engine.last_metrics, engine.asleep, engine.weights_path = None, {}, False, None
    assert isinstance(engine, RolloutRole)  # every engine: tests/components/test_rollout_protocol.py
    assert isinstance(_instance(Actor), PolicyRole)
    assert isinstance(_instance(Reference), ReferenceRole)
    assert isinstance(_instance(Critic), ValueRole)
    assert isinstance(_instance(RewardModel), RewardModelRole)
    assert not isinstance(_instance(Reference), ValueRole)
