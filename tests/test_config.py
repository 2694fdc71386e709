"""Config: YAML recipes, key=value overrides, slime flags, and errors that name the key."""

import re

import pytest

from miles_core.config.loader import load_config
from miles_core.errors import ConfigError


def test_defaults_validate():
    cfg = load_config()
    assert cfg.algorithm.advantage_estimator == "grpo" and cfg.rollout.batch_size == 16


def test_recipe_then_overrides_then_flags(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  temperature: 0.7\n  batch_size: 8\ntrain:\n  lr: 0.01\n")
    cfg = load_config(recipe, ["rollout.batch_size=4", "--lr", "2e-5", "--n-samples-per-prompt=3", "--rollout.top_p", "0.9"])
    assert cfg.rollout.temperature == 0.7
    assert cfg.rollout.batch_size == 4
    assert cfg.train.lr == pytest.approx(2e-5)
    assert cfg.rollout.n_samples_per_prompt == 3
    assert cfg.rollout.top_p == 0.9


@pytest.mark.parametrize(
    "flag,key,value,expected",
    [
        ("--advantage-estimator", "algorithm.advantage_estimator", "grpo", "grpo"),
        ("--rollout-batch-size", "rollout.batch_size", "12", 12),
        ("--num-rollout", "run.num_rollout", "7", 7),
        ("--rollout-max-response-len", "rollout.max_response_len", "9", 9),
        ("--rollout-temperature", "rollout.temperature", "0.5", 0.5),
        ("--eps-clip", "algorithm.eps_clip", "0.1", 0.1),
        ("--save", "run.save", "out/model", "out/model"),
        ("--load", "run.load", "in/model", "in/model"),
        ("--seed", "run.seed", "42", 42),
        ("--hf-checkpoint", "model.hf_checkpoint", "/models/x", "/models/x"),
        # slime flags with the same meaning and unit as a Miles key (slime/utils/arguments.py, Megatron's --clip-grad)
        ("--entropy-coef", "algorithm.entropy_coef", "0.001", 0.001),
        ("--eps-clip-c", "algorithm.clip_c", "3", 3.0),
        ("--value-clip", "algorithm.value_clip", "0.3", 0.3),
        ("--gamma", "algorithm.gamma", "0.99", 0.99),
        ("--lambd", "algorithm.lam", "0.9", 0.9),
        ("--num-steps-per-rollout", "train.updates_per_rollout", "4", 4),
        ("--clip-grad", "train.grad_clip", "0.5", 0.5),
    ],
)
def test_slime_flags(flag, key, value, expected):
    cfg = load_config(None, [flag, value])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == expected


def test_slime_gspo_estimator_is_grpo_with_the_gspo_loss():
    # slime's --advantage-estimator gspo: GRPO advantages, sequence-level ratio in the policy loss
    a = load_config(None, ["--advantage-estimator", "gspo"]).algorithm
    assert (a.advantage_estimator, a.policy_loss) == ("grpo", "gspo")
    a = load_config(None, ["--advantage-estimator=reinforce_plus_plus"]).algorithm
    assert (a.advantage_estimator, a.policy_loss) == ("reinforce_plus_plus", "ppo_clip")


def _kl(cfg):
    a = cfg.algorithm
    return a.kl_coef, a.kl_mode, a.kl_estimator


@pytest.mark.parametrize(
    "flags, expected",
    [
        # slime's --kl-coef is the KL penalty in the reward (slime/utils/arguments.py), not a loss term
        (["--kl-coef", "0.01"], (0.01, "reward", "auto")),
        # slime's KL loss: --use-kl-loss with --kl-loss-coef; --kl-loss-type picks the estimator
        (["--use-kl-loss", "--kl-loss-coef", "0.02", "--kl-loss-type", "k2"], (0.02, "loss", "k2")),
        (["--use-kl-loss", "--kl-loss-coef=0.02", "--kl-loss-type=low_var_kl"], (0.02, "loss", "k3_clamped")),
        (["--kl-loss-type", "k3", "--kl-loss-coef", "0.02", "--use-kl-loss"], (0.02, "loss", "k3")),
        # the typical slime script: a zero coefficient never forces its mode on the other flag's KL
        (["--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--kl-coef", "0.00"], (0.0, "loss", "k3_clamped")),
        (["--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "k1", "--kl-coef", "0.03"], (0.03, "reward", "k1")),
        (["--kl-coef", "0.03", "--use-kl-loss", "--kl-loss-coef", "0"], (0.03, "reward", "auto")),
        (["--kl-coef", "0", "--use-kl-loss", "--kl-loss-coef", "0.04"], (0.04, "loss", "auto")),
        (["--use-kl-loss", "--kl-loss-coef", "0.04", "--kl-coef", "0"], (0.04, "loss", "auto")),
    ],
)
def test_slime_kl_flags_mean_what_they_meant_in_slime(flags, expected):
    assert _kl(load_config(None, flags)) == expected


def test_slime_kl_flags_override_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: {kl_coef: 0.05, kl_mode: loss}\n")
    assert _kl(load_config(recipe, ["--kl-coef", "0.01"])) == (0.01, "reward", "auto")
    # all the script's KL coefficients are zero: no KL, as in slime
    assert load_config(recipe, ["--use-kl-loss", "--kl-loss-coef", "0", "--kl-coef", "0"]).algorithm.kl_coef == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        # slime refuses both too; Miles has one KL term at a time
        (["--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-coef", "0.02"], "--kl-coef 0.02 .* --kl-loss-coef 0.01"),
        (["--kl-coef", "0.02", "--kl-loss-coef", "0.01", "--use-kl-loss"], "--kl-coef 0.02 .* --kl-loss-coef 0.01"),
        # in slime --kl-loss-coef does nothing without --use-kl-loss
        (["--kl-loss-coef", "0.01"], "--kl-loss-coef 0.01 .*--use-kl-loss"),
        (["--kl-loss-type", "k4"], "--kl-loss-type must be one of k1, k2, k3, low_var_kl, got 'k4'"),
        (["--kl-coef", "-0.1"], "--kl-coef must be >= 0"),
        (["--kl-coef", "lots"], "--kl-coef must be a number, got 'lots'"),
        (["--kl-coef", "0.01", "algorithm.kl_mode=loss"], "--kl-coef sets algorithm.kl_mode"),
        (["--kl-loss-type", "k2", "--algorithm.kl_estimator", "k3"], "--kl-loss-type sets algorithm.kl_estimator"),
    ],
)
def test_slime_kl_flags_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, flags)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temprature' \(did you mean 'rollout.temperature'\?\)"):
        load_config(None, ["rollout.temprature=0.5"])


def test_unknown_key_in_recipe_names_the_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'train.lrr' \(did you mean 'train.lr'\?\)"):
        load_config(recipe)


def test_unknown_flag_suggests():
    with pytest.raises(ConfigError, match="did you mean '--rollout-batch-size'"):
        load_config(None, ["--rollout-batch-sise", "3"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="'rollout.batch_size' must be an integer, got 'many'"):
        load_config(None, ["rollout.batch_size=many"])


def test_bad_value_names_the_key():
    with pytest.raises(ConfigError, match="rollout.top_p must be in"):
        load_config(None, ["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match="sync.bucket_mb must be > 0, got 0"):
        load_config(None, ["sync.bucket_mb=0"])
    with pytest.raises(ConfigError, match="sync.dist_backend must be auto, gloo or nccl, got 'mpi'"):
        load_config(None, ["sync.dist_backend=mpi"])


@pytest.mark.parametrize("override, message", [
    ("train.lr=0", "train.lr must be > 0, got 0"),
    ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1, got 0"),
    ("train.max_tokens_per_micro_batch=0", "train.max_tokens_per_micro_batch must be >= 1, got 0"),
    ("train.lr_decay=linear", "train.lr_decay must be constant or cosine, got 'linear'"),
    ("train.lr_decay_steps=-1", "train.lr_warmup_steps and train.lr_decay_steps must be >= 0"),
    ("train.lr_warmup_steps=-1", "train.lr_warmup_steps and train.lr_decay_steps must be >= 0"),
    ("train.updates_per_rollout=0", "train.updates_per_rollout must be >= 1, got 0"),
    ("train.logprob_chunk_size=0", "train.logprob_chunk_size must be >= 1, got 0"),
    ("train.attention=flex", "train.attention must be auto, sdpa, padded, varlen or cudnn, got 'flex'"),
    ("train.old_logprobs=never", "train.old_logprobs must be auto or recompute, got 'never'"),
    ("train.sft_warmup_steps=-1", "train.sft_warmup_steps must be >= 0, got -1"),
    # an empty SFT batch failed the first warm-up step with "max() arg is an empty sequence"
    ("train.sft_batch_size=0", "train.sft_batch_size must be >= 1, got 0"),
    # a negative SFT rate trained away from the demonstrations; 0 fell back to train.lr unsaid
    ("train.sft_lr=-0.001", r"train.sft_lr must be > 0 \(or null: train.lr\), got -0.001"),
    ("train.sft_lr=0", r"train.sft_lr must be > 0 \(or null: train.lr\), got 0"),
    # AdamW refused these with a ValueError traceback once the run folder was made; a resume set them unchecked
    ("train.adam_beta1=1.5", r"train.adam_beta1 must be in \[0, 1\), got 1.5"),
    ("train.adam_beta2=1", r"train.adam_beta2 must be in \[0, 1\), got 1.0"),
    ("train.adam_beta2=-0.1", r"train.adam_beta2 must be in \[0, 1\), got -0.1"),
    ("train.weight_decay=-0.01", "train.weight_decay must be >= 0, got -0.01"),
    # a negative max norm turned clipping off as 0 does, where the doc names only 0
    ("train.grad_clip=-1", r"train.grad_clip must be >= 0 \(0 disables clipping\), got -1.0"),
    # the cosine schedule ended on a negative rate (gradient ascent), or rose from train.lr to a floor above it
    ("train.min_lr=-1e-6", "train.min_lr must be >= 0, got -1e-06"),
    (["train.lr_decay=cosine", "train.lr=1e-5", "train.min_lr=1e-4"], r"train.min_lr \(0.0001\) must not exceed train.lr \(1e-05\)"),
])
def test_bad_train_value_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override if isinstance(override, list) else [override])


def test_a_bool_is_not_a_number():
    with pytest.raises(ConfigError, match="'rollout.batch_size' must be an integer, got True"):
        load_config(None, ["rollout.batch_size=true"])
    with pytest.raises(ConfigError, match="'train.lr' must be a number, got False"):
        load_config(None, ["train.lr=false"])
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0  # an integer is a number


def test_invalid_yaml_names_the_line(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("run:\n  name: x\n   bad: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml line \d+: not valid YAML"):
        load_config(recipe)


def test_missing_recipe():
    with pytest.raises(ConfigError, match="recipe file 'nope.yaml' does not exist"):
        load_config("nope.yaml")


def test_a_seed_torch_cannot_take_is_refused():
    """torch.manual_seed takes [-2**63, 2**64); a larger --seed stopped build() with torch's ValueError traceback."""
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ConfigError, match=rf"run.seed must be in \[-2\*\*63, 2\*\*64\), got {seed}"):
            load_config(None, ["--seed", str(seed)])
    assert load_config(None, ["--seed", str(2**64 - 1)]).run.seed == 2**64 - 1
    assert load_config(None, ["--seed", "-1"]).run.seed == -1


def test_nan_is_not_a_number_a_config_key_takes():
    """Every range check is a comparison, and NaN fails none of them: train.lr=nan trained to NaN weights and
    reward.timeout_s=nan timed out every async reward at once ('timed out after nans')."""
    for override in ("train.lr=nan", "reward.timeout_s=.nan", "algorithm.eps_clip=NaN"):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=f"config key '{key}' must be a number, got nan"):
            load_config(None, [override])
    assert load_config(None, ["reward.timeout_s=inf"]).reward.timeout_s == float("inf")  # no limit: still a number


@pytest.mark.parametrize("args, key, expected", [
    (["--save", "runs/lr 1e-5 #2"], "run.save", "runs/lr 1e-5 #2"),  # YAML took ' #2' for a comment: saved to runs/lr 1e-5
    (["--save", "1e-5"], "run.save", "1e-5"),  # read as a float: '1e-05'
    (["--load", "0755"], "run.load", "0755"),  # read as YAML 1.1 octal: '493'
    (["--hf-checkpoint", "007"], "model.hf_checkpoint", "007"),  # '7'
    (["run.name=1.10"], "run.name", "1.10"),  # '1.1'
    (["run.name=yes"], "run.name", "yes"),  # refused: 'must be a string, got True'
    (["data.train_path=1e3"], "data.train_path", "1e3"),
    (["--save", "null"], "run.save", None),  # an optional text key is still unset by null / none / ~
    (["run.save=None"], "run.save", None),
])
def test_a_text_key_takes_its_command_line_value_as_written(args, key, expected):
    """A path or a name on the command line was read as YAML and turned back into text, so the folder written or
    read was another one than the user gave."""
    cfg = load_config(None, args)
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == expected


def test_a_key_given_twice_in_a_recipe_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys silently: a recipe with a second `algorithm:` section (a snippet from
    docs/algorithms.md pasted below its own) lost every key of the first."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: {kl_coef: 0.05, advantage_estimator: rloo}\nrun:\n  seed: 3\nalgorithm: {loss_agg: seq_sum}\n")
    with pytest.raises(ConfigError, match=r"r.yaml line 4: not valid YAML \('algorithm' is given twice\)"):
        load_config(recipe)
    recipe.write_text("run:\n  seed: 3\n  name: a\n  seed: 4\n")
    with pytest.raises(ConfigError, match=r"r.yaml line 4: not valid YAML \('seed' is given twice\)"):
        load_config(recipe)
    recipe.write_text("run: {<<: {seed: 3, name: a}, name: b}\n")  # a merge key may still be overridden
    cfg = load_config(recipe)
    assert (cfg.run.seed, cfg.run.name) == (3, "b")


@pytest.mark.parametrize("theta", ["0", "-10000"])
def test_a_rope_theta_that_is_not_positive_is_refused(theta):
    """model.rope_theta 0 made every rotary frequency but the first inf (negative: nan), so every logit was nan and
    the run trained on nan losses without a word."""
    with pytest.raises(ConfigError, match=f"model.rope_theta must be > 0, got {float(theta)}"):
        load_config(None, [f"model.rope_theta={theta}"])


def test_an_override_of_one_mapping_entry_keeps_the_others(tmp_path):
    """data.task_options.size=5000 replaced the whole mapping with {'size': 5000}: the recipe's dataset, seeds and
    config were dropped silently and the run trained on another task."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  task_options: {dataset: basic_arithmetic, size: 20000, config: {min_terms: 2, max_terms: 2}}\n")
    cfg = load_config(recipe, ["data.task_options.size=5000", "--data.task_options.config.max_terms", "3"])
    assert cfg.data.task_options == {"dataset": "basic_arithmetic", "size": 5000, "config": {"min_terms": 2, "max_terms": 3}}
    cfg = load_config(None, ["data.task_options.a=1", "data.task_options.b.c=x"])
    assert cfg.data.task_options == {"a": 1, "b": {"c": "x"}}
    assert load_config(recipe, ["data.task_options={size: 7}"]).data.task_options == {"size": 7}  # the whole mapping
    with pytest.raises(ConfigError, match=r"'data.task_options.dataset' is 'basic_arithmetic', not a mapping"):
        load_config(recipe, ["data.task_options.dataset.x=1"])


def test_a_recipe_takes_a_number_written_without_a_dot(tmp_path):
    """PyYAML (YAML 1.1) reads 1e-5 as text, so a recipe with `lr: 1e-5` was refused with "must be a number, got
    '1e-5'", while the same value on the command line was taken."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 1e-5\n  sft_lr: -2E+1\nalgorithm:\n  critic_lr: 3e-6\n  kl_coef: .5e-3\n")
    with pytest.raises(ConfigError, match=r"train.sft_lr must be > 0"):  # read as a number, then range-checked
        load_config(recipe)
    recipe.write_text("train:\n  lr: 1e-5\nalgorithm:\n  critic_lr: 3e-6\n  kl_coef: .5e-3\n")
    cfg = load_config(recipe)
    assert (cfg.train.lr, cfg.algorithm.critic_lr, cfg.algorithm.kl_coef) == (1e-5, 3e-6, 5e-4)
    recipe.write_text("train:\n  lr: 1e-5x\n")
    with pytest.raises(ConfigError, match=r"config key 'train.lr' must be a number, got '1e-5x'"):
        load_config(recipe)


def test_a_rollout_batch_of_no_sequences_is_refused_by_its_key():
    """rollout.max_batch_size=0 passed validation; the run made its folder, printed its header and then stopped on
    'engine.max_num_seqs must be >= 1', a key the user cannot set."""
    with pytest.raises(ConfigError, match="rollout.max_batch_size must be >= 1, got 0"):
        load_config(None, ["rollout.max_batch_size=0"])


def test_a_negative_thread_count_is_refused_by_its_key():
    """run.num_threads=-2 was ignored in a local run, and under a Ray placement reached torch.set_num_threads(-2) in
    every actor, which died with a RayActorError traceback ('set_num_threads expects a positive integer')."""
    with pytest.raises(ConfigError, match=r"run.num_threads must be >= 0 \(0 leaves torch's default\), got -2"):
        load_config(None, ["run.num_threads=-2"])
    assert load_config(None, ["run.num_threads=0"]).run.num_threads == 0


@pytest.mark.parametrize("override, error", [
    ("orchestration.engine_num_cpus=-1", r"orchestration.engine_num_cpus must be >= 0, got -1"),
    ("orchestration.trainer_num_gpus=-0.5", r"orchestration.trainer_num_gpus must be >= 0, got -0.5"),
    ("orchestration.engine_num_cpus=0", r"an engine actor asks for no resources: set orchestration.engine_num_cpus or engine_num_gpus > 0"),
    ("orchestration.trainer_num_cpus=0", r"a trainer actor asks for no resources: set orchestration.trainer_num_cpus or trainer_num_gpus > 0"),
])
def test_ray_resources_ray_refuses_are_refused_by_their_key(override, error):
    """A negative *_num_cpus/_num_gpus, or an actor's bundle of 0 CPUs and 0 GPUs, passed validation; under a Ray
    placement the run stopped on Ray's ValueError traceback ('The quantity of resource num_cpus cannot be negative',
    'Bundles cannot be an empty dictionary or resources with only 0 values') after the run folder was made."""
    with pytest.raises(ConfigError, match=error):
        load_config(None, ["orchestration.placement=ray_disaggregated", override])
    # colocated, the engines and the trainer share one bundle: an engine of 0 CPUs takes the trainer's
    cfg = load_config(None, ["orchestration.placement=ray_colocated", "orchestration.engine_num_cpus=0"])
    assert cfg.orchestration.engine_num_cpus == 0
    with pytest.raises(ConfigError, match=r"the colocated bundle asks for no resources"):
        load_config(None, ["orchestration.placement=ray_colocated", "orchestration.engine_num_cpus=0", "orchestration.trainer_num_cpus=0"])


def test_a_negative_restart_budget_is_refused_by_its_key():
    """rollout.sglang.max_restarts=-1 passed validation and acted as 0: the first engine death failed the run."""
    with pytest.raises(ConfigError, match=r"rollout.sglang.max_restarts must be >= 0 \(0: no restarts\), got -1"):
        load_config(None, ["rollout.sglang.max_restarts=-1"])


@pytest.mark.parametrize("args", [["--save", "--resume"], ["--load", "--num-rollout", "1"], ["--rollout.top_p", "--lr", "1e-6"]])
def test_a_flag_whose_value_is_the_next_flag_needs_a_value(args):
    # `--save --resume` (the folder forgotten) saved to a folder named '--resume' and did not resume, and validate said
    # ok; `--load --num-rollout 1` blamed '1' ("cannot read argument '1'"), not the option that lost its value
    with pytest.raises(ConfigError, match=rf"^option '{args[0]}' needs a value$"):
        load_config(None, args)


def test_a_recipe_that_is_a_folder_is_named_as_a_folder(tmp_path):
    # `miles run runs/kl-20250101-000000` (the run folder, not its config.yaml) said "does not exist", and it does
    with pytest.raises(ConfigError, match=rf"^recipe '{re.escape(str(tmp_path))}' is a folder, not a YAML file$"):
        load_config(tmp_path)
    (tmp_path / "config.yaml").write_text("run:\n  seed: 3\n")
    hint = rf"\(did you mean '{re.escape(str(tmp_path / 'config.yaml'))}'\?\)"
    with pytest.raises(ConfigError, match=rf"^recipe '{re.escape(str(tmp_path))}' is a folder, not a YAML file {hint}$"):
        load_config(tmp_path)
