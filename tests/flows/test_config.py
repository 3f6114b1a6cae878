"""flows.config: defaults, YAML loading, `key=value` overrides and one-line user errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pydantic import BaseModel

from flows.config import Config, ConfigError, build_config, flatten, load_config, parse_override

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def config_error(overrides: list[str], data: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(data, overrides)
    message = str(info.value)
    assert "\n" not in message, f"ConfigError must be one line, got {message!r}"
    assert message.strip() == message and message
    return message


# --- defaults and the quickstart file -------------------------------------------------------------


def test_defaults_build():
    config = build_config()
    assert isinstance(config, Config)
    assert config.run.name == "quickstart"
    assert config.actor.optim.lr == 1e-5
    assert config.critic.optim.lr == 1e-5
    assert config.rollout.n == 8
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor.micro_batch_size <= config.actor.ppo_mini_batch_size * config.rollout.n  # samples vs prompts
    assert config.data.max_val_prompts is None
    # load_config without a path gives the same defaults
    assert load_config() == config
    assert load_config(None, []) == Config()


def test_default_sections_are_not_shared_between_configs():
    # Defaults are model instances; pydantic must copy them so one config's edit is not another's.
    first, second = build_config(), build_config()
    first.actor.optim.lr = 0.5
    assert second.actor.optim.lr == 1e-5
    assert Config().actor.optim.lr == 1e-5


def test_quickstart_yaml_values():
    raw = yaml.safe_load(QUICKSTART.read_text())
    config = load_config(QUICKSTART)
    assert config.actor.optim.lr == 2e-4
    assert isinstance(config.actor.optim.lr, float)
    assert config.rollout.n == 8
    assert config.algorithm.adv_estimator == "grpo"
    assert config.data.max_prompt_length == 16
    assert config.data.prompts_per_step == 32
    assert config.rollout.max_new_tokens == 4
    assert config.rollout.val_temperature == 1.0
    assert config.actor.ppo_mini_batch_size == 16  # prompts (x rollout.n=8: 128 samples)
    assert config.actor.micro_batch_size == 128
    assert config.actor.use_kl_loss is True
    assert config.warm_start.steps == 300
    assert config.warm_start.batch_size == 64
    assert config.warm_start.lr == 1e-3
    assert config.trainer.total_steps == 200
    assert config.trainer.val_every == 10
    assert config.trainer.device == "cpu"
    # every leaf written in the YAML comes through unchanged
    flat = flatten(config)

    def leaves(prefix, node):
        if isinstance(node, dict):
            for key, child in node.items():
                yield from leaves(f"{prefix}.{key}" if prefix else key, child)
        else:
            yield prefix, node

    for key, value in leaves("", raw):
        assert flat[key] == value, key
    # fields not in the YAML keep their defaults
    assert config.trainer.seed == 0
    assert config.rollout.top_p == 1.0
    assert config.run.name == "quickstart"


def test_load_config_accepts_str_path_and_overrides():
    config = load_config(str(QUICKSTART), ["actor.optim.lr=1e-5", "trainer.total_steps=3"])
    assert config.actor.optim.lr == 1e-5
    assert config.trainer.total_steps == 3
    assert config.rollout.n == 8  # untouched YAML value


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert load_config(path) == Config()


# --- overrides ------------------------------------------------------------------------------------


def test_exponent_without_dot_reaches_the_config_as_a_float():
    # PyYAML reads "1e-4" as text; pydantic converts it for the float field.
    assert build_config(overrides=["actor.optim.lr=1e-4"]).actor.optim.lr == 1e-4


def test_parse_override():
    assert parse_override("actor.optim.lr=1.0e-4") == (["actor", "optim", "lr"], 1e-4)
    assert parse_override("trainer.total_steps=7") == (["trainer", "total_steps"], 7)
    assert parse_override("data.train_files=[a.parquet,b.parquet]") == (
        ["data", "train_files"],
        ["a.parquet", "b.parquet"],
    )
    # only the first '=' splits: a value may contain '='
    assert parse_override("tracking.tracking_uri=http://h/?a=b") == (
        ["tracking", "tracking_uri"],
        "http://h/?a=b",
    )
    assert parse_override("run.storage_root=") == (["run", "storage_root"], "")
    assert parse_override(" trainer.seed =3") == (["trainer", "seed"], 3)


def test_nested_float_override():
    config = build_config(overrides=["actor.optim.lr=1e-5"])
    assert config.actor.optim.lr == 1e-5
    assert isinstance(config.actor.optim.lr, float)
    # the other optimizer fields keep their defaults, and the critic's optimizer is separate
    assert config.actor.optim.grad_clip == 1.0
    assert config.critic.optim.lr == 1e-5
    config = build_config(overrides=["actor.optim.lr=3e-4"])
    assert config.actor.optim.lr == 3e-4
    assert config.critic.optim.lr == 1e-5


def test_list_override():
    config = build_config(overrides=["data.train_files=[a.parquet,b.parquet]"])
    assert config.data.train_files == ["a.parquet", "b.parquet"]
    assert config.data.val_files == [".rlhf/data/arithmetic/validation.parquet"]


def test_int_and_bool_overrides():
    config = build_config(overrides=["trainer.total_steps=7", "actor.use_kl_loss=true", "run.overwrite=false"])
    assert config.trainer.total_steps == 7
    assert type(config.trainer.total_steps) is int
    assert config.actor.use_kl_loss is True
    assert config.run.overwrite is False


def test_override_creates_missing_sections():
    # data has no `algorithm` or `kl_ctrl` section at all
    config = build_config(
        {"trainer": {"total_steps": 3}},
        ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1", "algorithm.kl_ctrl.horizon=1000"],
    )
    assert config.algorithm.kl_ctrl.type == "adaptive"
    assert config.algorithm.kl_ctrl.target_kl == 0.1
    assert config.algorithm.kl_ctrl.horizon == 1000
    assert config.trainer.total_steps == 3


def test_override_beats_yaml_and_later_override_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  optim: {lr: 0.1, weight_decay: 0.01}\n")
    config = load_config(path, ["actor.optim.lr=0.2", "actor.optim.lr=0.3"])
    assert config.actor.optim.lr == 0.3
    assert config.actor.optim.weight_decay == 0.01  # sibling from the YAML survives


def test_override_without_equals_raises():
    with pytest.raises(ConfigError) as info:
        build_config(overrides=["trainer.total_steps"])
    message = str(info.value)
    assert "trainer.total_steps" in message
    assert "key.path=value" in message
    assert "\n" not in message


def test_override_through_a_non_section_raises():
    message = config_error(["actor.optim.lr=1"], data={"actor": {"optim": 3}})
    assert "actor.optim.lr" in message
    assert "optim is not a section" in message


def test_build_config_does_not_mutate_its_input():
    data = {"actor": {"optim": {"lr": 0.1}}}
    build_config(data, ["actor.optim.lr=0.5", "actor.ppo_epochs=2"])
    assert data == {"actor": {"optim": {"lr": 0.1}}}


@pytest.mark.parametrize("override, field, expected", [
    ("run.name=2024", "name", "2024"),
    ("run.name=007", "name", "007"),
])
def test_numeric_looking_value_for_string_field(override, field, expected):
    config = build_config(overrides=[override])
    assert getattr(config.run, field) == expected


# --- one-line user errors -------------------------------------------------------------------------


def test_negative_lr():
    message = config_error(["actor.optim.lr=-1"])
    assert "actor.optim.lr=-1" in message
    assert "greater than 0" in message


def test_non_numeric_lr():
    message = config_error(["actor.optim.lr=abc"])
    assert "actor.optim.lr='abc'" in message


def test_fractional_int():
    message = config_error(["trainer.total_steps=1.5"])
    assert "trainer.total_steps=1.5" in message


def test_unknown_field():
    message = config_error(["actor.lrr=1"])
    assert "actor.lrr" in message
    assert "unknown field" in message


def test_unknown_section():
    message = config_error(["actr.optim.lr=1"])
    assert "actr" in message
    assert "unknown field" in message


def test_bad_enum():
    message = config_error(["rollout.engine=foo"])
    assert "rollout.engine='foo'" in message
    assert "'hf'" in message
    message = config_error(["model.dtype=fp8"])  # the old name of model.compute_dtype
    assert "model.dtype='fp8'" in message
    message = config_error(["model.compute_dtype=fp8"])
    assert "model.compute_dtype='fp8'" in message
    assert "bfloat16" in message


def test_unknown_advantage_estimator():
    message = config_error(["algorithm.adv_estimator=foo"])
    assert "algorithm.adv_estimator='foo'" in message
    for name in ("gae", "grpo", "rloo"):
        assert name in message


@pytest.mark.parametrize("field", ["algorithm.kl_penalty", "actor.kl_loss_type"])
def test_unknown_kl_estimator(field):
    message = config_error([f"{field}=foo"])
    assert f"{field}='foo'" in message
    assert "low_var_kl" in message and "k1" in message


def test_unknown_policy_loss():
    message = config_error(["actor.policy_loss=foo"])
    assert "actor.policy_loss='foo'" in message
    assert "ppo" in message


@pytest.mark.parametrize("field", ["actor.loss_agg_mode", "critic.loss_agg_mode"])
def test_bad_loss_agg_mode(field):
    message = config_error([f"{field}=mean"])
    assert f"{field}='mean'" in message
    assert "token-mean" in message and "seq-mean-token-sum" in message


def test_adaptive_kl_without_target():
    message = config_error(["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=100"])
    assert "algorithm.kl_ctrl" in message
    assert "adaptive" in message
    assert "target_kl" in message


def test_reward_model_without_path():
    message = config_error(["reward.kind=model"])
    assert "reward.model_path" in message
    assert "reward.kind=model" in message
    # with a path it validates
    assert build_config(overrides=["reward.kind=model", "reward.model_path=rm"]).reward.model_path == "rm"


def test_micro_batch_larger_than_mini_batch():
    """Mini-batches count prompts (verl's unit), micro-batches samples: 32 prompts x rollout.n=8 = 256 samples."""
    message = config_error(["actor.micro_batch_size=512", "actor.ppo_mini_batch_size=32"])
    assert message == ("actor.micro_batch_size=512 (samples) must be <= the mini-batch's 256 samples "
                       "(actor.ppo_mini_batch_size=32 prompts x rollout.n=8)")
    build_config(overrides=["actor.micro_batch_size=256", "actor.ppo_mini_batch_size=32"])  # equal is fine
    # the critic is checked when the run has one (it used to pass silently)
    assert "critic.micro_batch_size=64" in config_error(["algorithm.adv_estimator=gae", "critic.micro_batch_size=64",
                                                         "critic.ppo_mini_batch_size=4", "rollout.n=8"])
    build_config(overrides=["critic.micro_batch_size=64", "critic.ppo_mini_batch_size=4"])  # GRPO: no critic


def test_run_name_with_slash():
    message = config_error(["run.name=a/b"])
    assert "run.name='a/b'" in message


def test_several_errors_stay_on_one_line():
    message = config_error(["actor.optim.lr=-1", "rollout.n=0"])
    assert "actor.optim.lr=-1" in message
    assert "rollout.n=0" in message


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "does not exist" in message
    assert "\n" not in message


def test_yaml_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "mapping" in message
    assert "\n" not in message


def test_invalid_yaml_raises_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor: {optim: [\n  lr: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "not valid YAML" in str(info.value)


def test_invalid_yaml_error_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor: {optim: [\n  lr: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_config_error_is_a_value_error():
    # the CLI turns ValueError into one `error:` line
    assert issubclass(ConfigError, ValueError)


# --- flatten and derived properties ---------------------------------------------------------------


def test_flatten():
    config = load_config(QUICKSTART)
    flat = flatten(config)
    assert flat["actor.optim.lr"] == config.actor.optim.lr == 2e-4
    assert flat["data.train_files"] == [".rlhf/data/arithmetic/train.parquet"]
    assert isinstance(flat["data.train_files"], list)
    assert flat["algorithm.kl_ctrl.type"] == "fixed"
    assert flat["data.max_val_prompts"] is None
    assert flat["actor.optim.betas"] == [0.9, 0.999]  # JSON mode: tuples become lists
    assert flat["critic.model_path"] is None
    # only leaves, all dotted, none of them sections
    assert "actor" not in flat and "actor.optim" not in flat
    assert all(not isinstance(value, dict) or value == {} for value in flat.values())
    assert flat["placement.roles"] == {}  # an empty mapping is a leaf, not dropped
    assert all(key.count(".") >= 1 for key in flat)
    # one key per leaf field of the model
    def count(model_cls):
        total = 0
        for field in model_cls.model_fields.values():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                total += count(annotation)
            else:
                total += 1
        return total

    assert len(flat) == count(Config)


@pytest.mark.parametrize("estimator, expected", [
    ("gae", True), ("grpo", False), ("rloo", False), ("grpo_no_std", False), ("reinforce_plus_plus", False),
])
def test_uses_critic(estimator, expected):
    assert build_config(overrides=[f"algorithm.adv_estimator={estimator}"]).uses_critic is expected


def test_samples_per_step():
    assert build_config().samples_per_step == 32 * 8
    config = build_config(overrides=["data.prompts_per_step=5", "rollout.n=3"])
    assert config.samples_per_step == 15


# --- JSON schema (the Prefect UI's parameter form) ------------------------------------------------


def test_json_schema_builds():
    schema = Config.model_json_schema()
    assert schema["description"] == "Everything one training run needs."
    optim = schema["$defs"]["OptimConfig"]["properties"]
    assert optim["lr"]["default"] == 1e-5
    assert optim["lr"]["exclusiveMinimum"] == 0
    assert schema["$defs"]["RolloutConfig"]["properties"]["engine"]["enum"] == ["auto", "vllm", "hf"]
    assert schema["$defs"]["ModelConfig"]["properties"]["compute_dtype"]["enum"] == ["float32", "bfloat16", "float16"]
    # Field docstrings are not in the schema (use_attribute_docstrings is not set), so no check on
    # "description" of the fields here.


def test_one_step_ahead_needs_workers():
    message = config_error(["trainer.one_step_ahead=true"])
    assert "trainer.one_step_ahead=true needs trainer.execution=workers" in message
    assert build_config(None, ["trainer.one_step_ahead=true", "trainer.execution=workers"]).trainer.one_step_ahead


def test_vllm_rollout_options_are_validated():
    assert "rollout.min_new_tokens=9 must be <= rollout.max_new_tokens=4" in config_error(
        ["rollout.min_new_tokens=9", "rollout.max_new_tokens=4"])
    assert "rollout.gpu_memory_utilization" in config_error(["rollout.gpu_memory_utilization=1.5"])


def test_rollout_sleep_takes_on_and_off_as_typed():
    # YAML reads a bare on/off as a boolean; README's `rollout.sleep=on|off` must still work
    assert build_config(None, ["rollout.sleep=off"]).rollout.sleep == "off"
    assert build_config({"rollout": {"sleep": True}}, []).rollout.sleep == "on"
    assert build_config(None, ["rollout.sleep=auto"]).rollout.sleep == "auto"
    assert "rollout.sleep" in config_error(["rollout.sleep=sometimes"])


def test_several_rollout_engines_need_vllm():
    message = config_error(["rollout.engines=2", "rollout.engine=hf"])
    assert message.startswith("rollout.engines=2: several engines are vLLM engines"), message
    assert "rollout.engines" in config_error(["rollout.engines=0"])
    assert build_config(None, ["rollout.engines=2"]).rollout.engines == 2


def test_a_run_name_of_dots_is_refused():
    for name in (".", ".."):
        assert config_error([f"run.name={name}"]) == (f"run.name={name!r}: {name!r} names no folder of its own; use "
                                                      "letters, digits, '.', '_' or '-'")
    assert build_config(overrides=["run.name=v1.2"]).run.name == "v1.2"


def test_multi_turn_rollout_options_are_validated():
    tools = ["rollout.tools=[calculator]", "rollout.max_turns=2"]
    assert config_error(["rollout.max_turns=3"]) == (
        "rollout.max_turns=3 needs rollout.tools (e.g. [calculator]): a turn after the first follows a tool's answer")
    assert config_error(["rollout.tools=[calculator]"]).startswith("rollout.tools=['calculator'] needs rollout.max_turns >= 2")
    assert config_error(["rollout.tools=[calc]", "rollout.max_turns=2"]) == (
        "rollout.tools=['calc']: 'calc' is not a tool; use a built-in tool (calculator) or 'module:function'")
    assert "module 'no_such_module' cannot be imported" in config_error(["rollout.tools=[no_such_module:f]",
                                                                        "rollout.max_turns=2"])
    assert config_error([*tools, "rollout.tool_response_template=no result"]) == (
        "rollout.tool_response_template='no result': must contain {result}, where the tool's answer goes")
    assert config_error([*tools, "rollout.max_turn_tokens=99"]) == (
        "rollout.max_turn_tokens=99 must be <= rollout.max_new_tokens=16 (the conversation's budget)")
    assert config_error([*tools, "rollout.ignore_eos=true"]).startswith("rollout.ignore_eos=true with rollout.max_turns > 1")
    config = build_config(None, [*tools, "rollout.max_turn_tokens=8"])
    assert (config.rollout.tools, config.rollout.max_turns, config.rollout.max_turn_tokens) == (["calculator"], 2, 8)


# --- LoRA: the reference is the actor's model, in the actor's worker ---------------------------------------------


def test_under_lora_the_reference_runs_in_the_actors_worker_and_gets_no_worker_of_its_own():
    from flows.config import worker_role

    full = build_config(None, ["actor.use_kl_loss=true", "trainer.execution=workers"])
    assert full.roles == ["rollout", "actor", "reward", "reference"]
    assert worker_role(full, "reference") == "reference"
    lora = build_config(None, ["actor.use_kl_loss=true", "trainer.execution=workers", "model.lora_rank=8"])
    assert lora.uses_reference and lora.roles == ["rollout", "actor", "reward"]
    assert {role: worker_role(lora, role) for role in ("rollout", "actor", "reference", "critic", "reward", "driver")} \
        == {"rollout": "rollout", "actor": "actor", "reference": "actor", "critic": "critic", "reward": "reward",
            "driver": "driver"}
    # the same in one process (the flow's process holds every role) and with a critic and the KL in the reward
    local = build_config(None, ["algorithm.use_kl_in_reward=true", "model.lora_rank=4", "algorithm.adv_estimator=gae"])
    assert local.roles == ["rollout", "actor", "reward", "critic"] and worker_role(local, "reference") == "actor"


def test_lora_with_a_sharded_actor_or_critic_is_refused_in_one_line_before_anything_is_created():
    workers = ["model.lora_rank=8", "trainer.execution=workers"]
    assert config_error([*workers, "placement.roles.actor=[0,1]"]) == (
        "model.lora_rank=8 with placement.roles.actor=[0, 1]: LoRA with the actor sharded over several GPUs (FSDP) "
        "is not supported yet; give the actor one GPU (e.g. placement.roles.actor=[0]) or set model.lora_rank=0 "
        "(full fine-tuning)")
    assert config_error([*workers, "algorithm.adv_estimator=gae", "placement.default=[2,3]",
                         "placement.roles.actor=[1]"]) == (
        "model.lora_rank=8 with placement.default=[2, 3] (used by the critic): LoRA with the critic sharded over "
        "several GPUs (FSDP) is not supported yet; give the critic one GPU (e.g. placement.roles.critic=[2]) or set "
        "model.lora_rank=0 (full fine-tuning)")
    # one GPU each, full fine-tuning on two, or one process (the placement applies only to workers): accepted
    build_config(None, [*workers, "placement.roles.actor=[1]", "placement.default=[0]"])
    build_config(None, ["trainer.execution=workers", "placement.roles.actor=[0,1]"])
    build_config(None, ["model.lora_rank=8", "placement.roles.actor=[0,1]"])
