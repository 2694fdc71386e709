"""User errors: one clear line on stderr, exit code 2, no traceback."""

import pytest


def _one_line_error(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    return lines[0]


def test_config_typo(cli, tmp_path):
    line = _one_line_error(cli("run", "rollout.temprature=0.5", f"run.output_dir={tmp_path}"))
    assert "rollout.temprature" in line and "did you mean 'rollout.temperature'" in line


def test_missing_data_file(cli, tmp_path):
    line = _one_line_error(cli("run", "data.task=jsonl", "data.task_options={}", f"data.train_path={tmp_path}/missing.jsonl", f"run.output_dir={tmp_path}"))
    assert "missing.jsonl" in line and "does not exist" in line


def test_reward_function_that_does_not_exist(cli, tmp_path):
    (tmp_path / "myrewards.py").write_text("def score(sample):\n    return 1.0\n")
    line = _one_line_error(cli("run", "reward.name=myrewards:scor", f"run.output_dir={tmp_path}", cwd=tmp_path))
    assert "myrewards:scor" in line and "no function 'scor'" in line and "did you mean 'score'" in line


def test_reward_module_that_does_not_exist(cli, tmp_path):
    line = _one_line_error(cli("validate", "reward.name=nosuchmodule:fn"))
    assert "module 'nosuchmodule' not found" in line


def test_a_reward_given_as_a_file_path(cli, tmp_path):
    """reward.name=path/to/file.py:function loads that file (no module on sys.path needed); a missing file, a missing
    function and a file that raises on import are each one line naming it."""
    from miles_core.errors import ConfigError
    from miles_core.rewards.custom import load_reward_path

    rewards = tmp_path / "my rewards" / "exact.py"
    rewards.parent.mkdir()
    rewards.write_text("def score(sample):\n    return float(sample.response == sample.label)\n")

    class Sample:
        response, label = "ab", "ab"

    assert load_reward_path(f"{rewards}:score")(Sample()) == 1.0
    with pytest.raises(ConfigError, match="does not exist"):
        load_reward_path(f"{tmp_path}/nope.py:score")
    with pytest.raises(ConfigError, match="has no function 'scor'.*did you mean 'score'"):
        load_reward_path(f"{rewards}:scor")
    (tmp_path / "broken.py").write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match="broken.py' raised RuntimeError: no GPU here"):
        load_reward_path(f"{tmp_path}/broken.py:score")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")  # argparse at import does this
    with pytest.raises(ConfigError, match="exits.py' raised SystemExit: 3"):
        load_reward_path(f"{tmp_path}/exits.py:score")
    proc = cli("validate", f"reward.name={rewards}:score")
    assert proc.returncode == 0, proc.stderr


def test_bad_jsonl_line_names_file_and_line(cli, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a?", "label": "a"}\n{"prompt": oops}\n')
    line = _one_line_error(cli("validate", "data.task=jsonl", "data.task_options={}", f"data.train_path={data}", f"data.eval_path={data}"))
    assert "d.jsonl:2: not valid JSON" in line


def test_unknown_component_name(cli):
    line = _one_line_error(cli("validate", "algorithm.advantage_estimator=grpp"))
    assert "unknown advantage estimator 'grpp' (config key 'algorithm.advantage_estimator') (did you mean 'grpo'?)" in line


def test_validate_takes_the_flags_run_takes(cli):
    # slime flags, --KEY VALUE config keys and --sglang-KEY: miles run takes them, so validate must too
    out = cli("validate", "--num-rollout", "3", "--rollout.top_p", "0.9", "--sglang-mem-fraction-static", "0.7")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok:")
    line = _one_line_error(cli("validate", "--rollout.top_pp", "0.9"))
    assert "rollout.top_pp" in line


def test_validate_refuses_what_the_placement_refuses(cli):
    # miles run refuses these when it makes the placement; validate built everything and said ok
    line = _one_line_error(cli("validate", "orchestration.placement=ray_colocated", "orchestration.schedule=one_step_off"))
    assert "orchestration.schedule=sync" in line
    line = _one_line_error(cli("validate", "orchestration.placement=ray_disaggregated", "algorithm.advantage_estimator=ppo"))
    assert "critic" in line
    line = _one_line_error(cli("validate", "orchestration.placement=ray_disaggregated", "sync.transport=disk"))
    assert "use sync.transport=in_process, not disk" in line  # was refused only at the run's first weight push


def test_validate_ok(cli):
    out = cli("validate")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok:") and "task reverse" in out.stdout


def test_serve_options_out_of_range(cli, tmp_path):
    for opt, value in (("--port", "99999"), ("--port", "-1"), ("--max-request-bytes", "0"), ("--max-num-seqs", "0")):
        proc = cli("serve", str(tmp_path), opt, value)
        assert proc.returncode == 2 and f"Invalid value for '{opt}'" in proc.stderr, (opt, value, proc.stderr)


def test_serve_device_that_is_not_there(cli, tmp_path):
    from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.plugins.manager import MilesPlugins

    model = Decoder(DecoderConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, num_layers=1, num_heads=4,
                                  num_kv_heads=2, intermediate_size=64))
    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), tmp_path / "m",
                   {CHAR_TOKENIZER_FILE: CharTokenizer().to_json()})
    line = _one_line_error(cli("serve", str(tmp_path / "m"), "--device", "tpu"))
    assert line == "error: --device 'tpu' is not a torch device (try auto, cpu or cuda)"


def test_group_baseline_with_one_sample_leaves_no_run_folder(cli, tmp_path):
    line = _one_line_error(cli("run", "rollout.n_samples_per_prompt=1", f"run.output_dir={tmp_path / 'runs'}"))
    assert "advantage_estimator=grpo" in line and "rollout.n_samples_per_prompt >= 2, got 1" in line
    assert not any((tmp_path / "runs").iterdir())  # refused before anything ran: no folder with only config.yaml
    assert "n_samples_per_prompt >= 2" in _one_line_error(cli("validate", "rollout.n_samples_per_prompt=1"))


def test_a_model_folder_that_does_not_exist_is_named(cli, tmp_path):
    """The tokenizer is read before the weights: a --load/--hf-checkpoint path that is not there was passed to
    transformers, which answered about hub repo ids ('Repo id must be in the form ...')."""
    line = _one_line_error(cli("validate", "--load", str(tmp_path / "runs" / "hf")))
    assert line == f"error: model checkpoint '{tmp_path / 'runs' / 'hf'}' does not exist"


def test_a_model_folder_without_a_tokenizer_is_one_line(cli, tmp_path):
    """transformers' error for a folder with no tokenizer files runs over five lines; the CLI prints one."""
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.plugins.manager import MilesPlugins

    model = Decoder(DecoderConfig(vocab_size=60, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64))
    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), tmp_path / "m")
    line = _one_line_error(cli("validate", "--hf-checkpoint", str(tmp_path / "m")))
    assert line.startswith(f"error: cannot load a tokenizer from '{tmp_path / 'm'}': ")


def test_custom_rm_path_takes_slime_s_dotted_path(cli, tmp_path):
    """--custom-rm-path is a slime flag, and slime's value is a dotted path (pkg.module.function); it was refused as
    an unknown registered reward. The module:function form still works."""
    (tmp_path / "myrewards.py").write_text("def score(sample):\n    return 1.0\n")
    for spec in ("myrewards.score", "myrewards:score"):
        out = cli("validate", "--custom-rm-path", spec, cwd=tmp_path)
        assert out.returncode == 0 and f"reward {spec}," in out.stdout, out.stderr
    line = _one_line_error(cli("validate", "--custom-rm-path", "myrewards.scor", cwd=tmp_path))
    assert "module 'myrewards' has no function 'scor'" in line and "did you mean 'score'" in line


def test_an_output_folder_under_a_file_is_refused_before_the_run(cli, tmp_path):
    """--save DIR is first written at the end of training: a DIR that is a file (or under one) failed then, with
    NotADirectoryError and a traceback, the whole run lost. --save-rollouts and run.output_dir failed likewise."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = _one_line_error(cli("validate", "--save", str(afile)))
    assert line == f"error: run.save '{afile}': '{afile}' is a file, not a folder"
    line = _one_line_error(cli("validate", "--save-rollouts", str(afile / "sub")))
    assert line == f"error: run.save_rollouts '{afile / 'sub'}': '{afile}' is a file, not a folder"
    line = _one_line_error(cli("run", f"run.output_dir={afile}"))
    assert line == f"error: run.output_dir '{afile}': '{afile}' is a file, not a folder"


def test_load_rollouts_from_a_folder_that_is_not_there_is_refused_by_validate(cli, tmp_path):
    """miles validate said ok; miles run built the trainer, ran the SFT warm-up, then stopped at step 1."""
    line = _one_line_error(cli("validate", "--load-rollouts", str(tmp_path / "nowhere")))
    assert line == f"error: run.load_rollouts: '{tmp_path / 'nowhere'}' does not exist (save rollouts there with --save-rollouts)"


def test_a_weights_file_given_as_the_model_folder_is_named_as_a_file(cli, tmp_path):
    """--hf-checkpoint takes the folder; given its model.safetensors (a file that is there) the error said
    'does not exist'."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    line = _one_line_error(cli("validate", "--hf-checkpoint", str(weights)))
    assert line == f"error: model checkpoint '{weights}' is a file; give the HF folder that holds it (or a .gguf file)"


def test_a_recipe_that_is_not_yaml_text_is_one_line(cli, tmp_path):
    """A model file given as RECIPE by mistake (or a recipe saved in Latin-1): bytes that are not UTF-8 stopped
    load_config with UnicodeDecodeError and a traceback; control characters gave a two-line YAML error."""
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    line = _one_line_error(cli("validate", str(latin1)))
    assert line.startswith(f"error: {latin1}: not UTF-8 text")
    binary = tmp_path / "model.gguf"
    binary.write_bytes(b"GGUF\x03\x00\x00\x00")
    line = _one_line_error(cli("validate", str(binary)))
    assert line.startswith(f"error: {binary}: not valid YAML (unacceptable character")


def test_a_chat_row_that_renders_to_no_tokens_is_named_with_its_line(cli, tmp_path):
    """The character tokenizer has no chat template: a row's 'messages' are not rendered and its empty prompt text
    passed start-up, then failed mid-run (an IndexError in the trainer, exit 1; the built-in engine's "the prompt is
    empty" named no file). The error names the file and line."""
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "", "messages": [{"role": "user", "content": "2+2="}], "label": "4"}\n')
    held_out.write_text('{"prompt": "1+1=", "label": "2"}\n')
    line = _one_line_error(cli("run", "data.task=jsonl", "data.task_options={}", f"data.train_path={train}",
                               f"data.eval_path={held_out}", "--num-rollout", "1", f"run.output_dir={tmp_path}"))
    assert line.startswith(f"error: {train}:2: the prompt is empty"), line


def test_a_recipe_in_a_folder_with_an_equals_sign_is_the_recipe(cli, tmp_path):
    """A run named kl=0.01 saves its config as runs/kl=0.01-<stamp>/config.yaml; given back as RECIPE it was taken
    for a key=value override ("'.../kl' is not a config key")."""
    recipe = tmp_path / "kl=0.01-20250101-000000" / "config.yaml"
    recipe.parent.mkdir()
    recipe.write_text("run:\n  name: kl=0.01\nrollout:\n  batch_size: 3\n")
    out = cli("validate", str(recipe), "run.seed=2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"ok: {recipe}")


def test_slime_reward_kl_and_kl_loss_together_is_one_line(cli):
    line = _one_line_error(cli("validate", "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl", "--kl-coef", "0.02"))
    assert "--kl-coef 0.02" in line and "--kl-loss-coef 0.01" in line


def test_a_run_folder_given_as_the_recipe_is_named_as_a_folder(cli, tmp_path):
    """A run folder given as RECIPE said "recipe file ... does not exist"; one named kl=0.01-<stamp> was taken for an
    override ("'.../kl' is not a config key")."""
    run_dir = tmp_path / "kl=0.01-20250101-000000"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run:\n  name: kl=0.01\n")
    line = _one_line_error(cli("validate", str(run_dir)))
    assert line == f"error: recipe '{run_dir}' is a folder, not a YAML file (did you mean '{run_dir / 'config.yaml'}'?)"


def test_ctrl_c_ends_miles_run_with_the_interrupt_exit_code(tmp_path):
    """Ctrl-C ended `miles run` with click's "Aborted!" and exit code 1, a failed run's: a scheduler or a script could
    not tell a cancelled run from a failed one. It exits 130 (128 + SIGINT), saying so."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "miles_cli.main", "run", f"run.output_dir={tmp_path}", "train.sft_warmup_steps=0",
                             "run.num_rollout=10000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not any(p.read_text() for p in tmp_path.glob("*/metrics.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert "interrupted (SIGINT)" in err.decode() and "Traceback" not in err.decode()


def test_a_reward_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """reward.name=rewards/mine.py:score with `from mine_helpers import ...` at its top (a helper module in the same
    folder, as `python rewards/mine.py` would find it) failed at start-up with "No module named 'mine_helpers'": the
    file was loaded without its folder on sys.path."""
    import sys

    from miles_core.rewards.custom import load_reward_path

    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "my rewards"
    folder.mkdir()
    (folder / "mine_helpers_h20.py").write_text("def norm(text):\n    return text.strip().lower()\n")
    (folder / "mine.py").write_text(
        "from mine_helpers_h20 import norm\n\n"
        "def score(sample):\n"
        "    return float(norm(sample.response) == norm(sample.label))\n"
    )

    class Sample:
        response, label = " AB ", "ab"

    try:
        assert load_reward_path(f"{folder / 'mine.py'}:score")(Sample()) == 1.0
    finally:
        sys.modules.pop("mine_helpers_h20", None)


def test_a_reward_file_without_its_function_is_named_as_such(tmp_path, monkeypatch):
    """reward.name=rewards/mine.py (the ':function' forgotten) was read as slime's dotted module.function, module
    'rewards/mine' and function 'py': "module 'rewards/mine' not found" for a file that exists (and for mine.py in
    the working folder, "module 'mine' has no function 'py'")."""
    from miles_core.errors import ConfigError
    from miles_core.rewards.custom import load_reward_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine_h20.py").write_text("def score(sample):\n    return 1.0\n")
    (tmp_path / "mine_h20b.py").write_text("def score(sample):\n    return 1.0\n")
    for spec in ("rewards/mine_h20.py", "mine_h20b.py"):
        with pytest.raises(ConfigError, match=rf"^reward.name '{spec}' names a file but no function: "
                                              rf"write '{spec}:function'$"):
            load_reward_path(spec)


def test_a_reward_file_with_dots_in_its_name_pickles_its_functions(tmp_path):
    """reward_v1.2.py was imported as module 'miles_reward_reward_v1.2', a dotted name whose parent package does not
    exist: pickling one of its functions (a ProcessPoolExecutor running a verifier with a time limit) failed with
    "import of module 'miles_reward_reward_v1.2' failed"."""
    import pickle

    from miles_core.rewards.custom import load_reward_path

    path = tmp_path / "reward_v1.2.py"
    path.write_text("def score(sample):\n    return 0.5\n")
    fn = load_reward_path(f"{path}:score")
    assert "." not in fn.__module__
    assert pickle.loads(pickle.dumps(fn)) is fn
