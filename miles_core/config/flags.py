"""The common slime/Miles command-line flags, mapped onto config keys.

Any config key also works as a flag (``--rollout.top_p 0.9``) or as ``key=value``.
``--sglang-KEY VALUE`` sets ``rollout.sglang.server_args.KEY`` (options for launched SGLang servers).
"""

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
    "--kl-coef": "algorithm.kl_coef",
    "--save": "run.save",
    "--load": "run.load",
    "--save-interval": "run.save_interval",
    "--max-tokens-per-micro-batch": "train.max_tokens_per_micro_batch",
    "--seed": "run.seed",
    "--micro-batch-size": "train.micro_batch_size",
    "--custom-rm-path": "reward.name",
    "--save-rollouts": "run.save_rollouts",
    "--load-rollouts": "run.load_rollouts",
}

# flags that take no value: present means true
SWITCH_FLAGS: dict[str, str] = {
    "--resume": "run.resume",
}
