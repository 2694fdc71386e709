"""The common slime/Miles command-line flags, mapped onto config keys.

Any config key also works as a flag (``--rollout.top_p 0.9``) or as ``key=value``.
``--sglang-KEY VALUE`` sets ``rollout.sglang.server_args.KEY`` (options for launched SGLang servers).

Each flag below means what slime's flag of that name means (slime/utils/arguments.py; Megatron's for --lr, --seed,
--save, --load, --save-interval, --micro-batch-size, --clip-grad), in the same unit: --rollout-batch-size counts
prompts (samples = prompts * --n-samples-per-prompt), --micro-batch-size samples per forward/backward on one rank,
--num-rollout and --save-interval rollout steps (a checkpoint also after the last), --num-steps-per-rollout optimizer
steps per rollout batch, --eps-clip-high None = --eps-clip, --eps-clip-c the dual-clip bound (> 1). Where Miles differs:

* --hf-checkpoint is the weights Miles trains from; slime takes them from --load / --ref-load (a Megatron checkpoint,
  usually converted from that folder) and reads --hf-checkpoint for the architecture and tokenizer.
* --load / --save are Miles folders (--load: a --save folder to resume, or an HF folder); a slime Megatron
  checkpoint is not read, and --ref-load is refused (Miles' reference is the policy at the start of RL).
* --custom-rm-path takes slime's dotted module.function, but the function is Miles' fn(sample) -> float;
  slime's fn(args, sample) is refused at start-up, naming its signature.
* --max-tokens-per-micro-batch, --save-rollouts, --load-rollouts and --resume are Miles' own flags, not slime's
  (slime: --max-tokens-per-gpu with --use-dynamic-batch-size; --save-debug-rollout-data, a different format).
* slime's --rollout-temperature must be > 0; Miles takes 0 as greedy. --rollout-top-k is not mapped (slime's -1
  for off is Miles' rollout.top_k=0).

``--advantage-estimator gspo`` is slime's GRPO advantage with GSPO's sequence-level ratio in the loss: Miles'
``advantage_estimator=grpo`` with ``policy_loss=gspo``. slime's cispo has no Miles counterpart (refused at start-up).

KL (slime/utils/arguments.py): ``--kl-coef X`` is slime's KL penalty in the reward, so it sets
``algorithm.kl_coef=X`` with ``algorithm.kl_mode=reward``; ``--use-kl-loss --kl-loss-coef X`` is its KL loss
(``kl_mode=loss``); ``--kl-loss-type`` (k1, k2, k3, low_var_kl) sets ``algorithm.kl_estimator`` (low_var_kl is
``k3_clamped``). Both nonzero is an error, as in slime; zero coefficients set no mode, and when all are zero the
KL is off. Where Miles differs:

* without ``--kl-loss-type`` Miles keeps ``algorithm.kl_estimator`` (auto: k1 in the reward, as slime's default
  k1; k3 as a loss, where slime's default is k1): pass ``--kl-loss-type k1`` for slime's KL loss exactly;
* slime's grpo/gspo advantages ignore ``--kl-coef`` (only ppo and reinforce_plus_plus(_baseline) read it);
  Miles' grpo subtracts ``kl_coef * sum_t kl_t`` from the reward.
"""

from miles_core.errors import ConfigError

SLIME_FLAGS: dict[str, str] = {
    "--advantage-estimator": "algorithm.advantage_estimator",
    "--rollout-batch-size": "rollout.batch_size",
    "--n-samples-per-prompt": "rollout.n_samples_per_prompt",
    "--hf-checkpoint": "model.hf_checkpoint",
    "--num-rollout": "run.num_rollout",
    "--lr": "train.lr",
    "--rollout-max-response-len": "rollout.max_response_len",
    "--rollout-temperature": "rollout.temperature",
    "--rollout-top-p": "rollout.top_p",
    "--eps-clip": "algorithm.eps_clip",
    "--eps-clip-high": "algorithm.eps_clip_high",
    "--save": "run.save",
    "--load": "run.load",
    "--save-interval": "run.save_interval",
    "--max-tokens-per-micro-batch": "train.max_tokens_per_micro_batch",
    "--seed": "run.seed",
    "--micro-batch-size": "train.micro_batch_size",
    "--custom-rm-path": "reward.name",
    "--save-rollouts": "run.save_rollouts",
    "--load-rollouts": "run.load_rollouts",
    "--entropy-coef": "algorithm.entropy_coef",
    "--eps-clip-c": "algorithm.clip_c",
    "--value-clip": "algorithm.value_clip",
    "--gamma": "algorithm.gamma",
    "--lambd": "algorithm.lam",
    "--num-steps-per-rollout": "train.updates_per_rollout",
    "--clip-grad": "train.grad_clip",
}

# slime's --advantage-estimator values that are two keys in Miles (gspo: GRPO advantages, GSPO's sequence-level ratio)
ESTIMATOR_VALUES: dict[str, tuple[tuple[str, str], ...]] = {
    "gspo": (("algorithm.advantage_estimator", "grpo"), ("algorithm.policy_loss", "gspo")),
}

# slime's KL flags, read together (resolve_kl_flags): one Miles KL term, algorithm.kl_coef with kl_mode reward or loss
KL_VALUE_FLAGS = ("--kl-coef", "--kl-loss-coef", "--kl-loss-type")
KL_SWITCH_FLAG = "--use-kl-loss"
# slime's --kl-loss-type -> algorithm.kl_estimator (low_var_kl is k3 clamped to at most 10)
KL_LOSS_TYPES: dict[str, str] = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "k3_clamped"}

# flags that take no value: present means true
SWITCH_FLAGS: dict[str, str] = {
    "--resume": "run.resume",
}


def _coefficient(flag: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{flag} must be a number, got '{raw}'") from None
    if not value >= 0:  # NaN too
        raise ConfigError(f"{flag} must be >= 0, got {raw}")
    return value


def resolve_kl_flags(given: dict[str, str], use_kl_loss: bool) -> list[tuple[str, str, str]]:
    """slime's KL flags (``given``: flag -> value, as on the command line) as (key, value, source) overrides.

    In slime ``--kl-coef`` is the KL penalty in the reward, and the KL loss is ``--use-kl-loss`` with
    ``--kl-loss-coef``; ``--kl-loss-type`` is the estimator of either. Miles has one KL term, so a nonzero
    reward KL and a nonzero KL loss are refused (slime refuses them too). A zero coefficient sets no mode;
    when every coefficient given is zero the KL is off (algorithm.kl_coef=0), as it is in slime.
    """
    out: list[tuple[str, str, str]] = []
    kind = given.get("--kl-loss-type")
    if kind is not None:
        if kind not in KL_LOSS_TYPES:
            raise ConfigError(f"--kl-loss-type must be one of {', '.join(KL_LOSS_TYPES)}, got '{kind}'")
        out.append(("algorithm.kl_estimator", KL_LOSS_TYPES[kind], "option --kl-loss-type"))
    reward = _coefficient("--kl-coef", given["--kl-coef"]) if "--kl-coef" in given else None
    loss = _coefficient("--kl-loss-coef", given["--kl-loss-coef"]) if "--kl-loss-coef" in given else None
    if reward and loss:
        raise ConfigError(
            f"--kl-coef {given['--kl-coef']} (a KL penalty in the reward) and --kl-loss-coef {given['--kl-loss-coef']} "
            "(a KL loss) are both nonzero; Miles applies one KL term: set the other to 0"
        )
    if loss and not use_kl_loss:
        raise ConfigError(
            f"--kl-loss-coef {given['--kl-loss-coef']} adds a KL loss only with --use-kl-loss (slime ignores it without): "
            "add --use-kl-loss, or drop --kl-loss-coef"
        )
    if loss:
        out += [("algorithm.kl_coef", given["--kl-loss-coef"], "option --kl-loss-coef"), ("algorithm.kl_mode", "loss", "option --kl-loss-coef")]
    elif reward:
        out += [("algorithm.kl_coef", given["--kl-coef"], "option --kl-coef"), ("algorithm.kl_mode", "reward", "option --kl-coef")]
    elif reward is not None or loss is not None or use_kl_loss:  # every KL the script names is zero: none at all
        flag = "--kl-coef" if reward is not None else "--kl-loss-coef" if loss is not None else KL_SWITCH_FLAG
        out.append(("algorithm.kl_coef", "0", f"option {flag}"))
    return out
