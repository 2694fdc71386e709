import sys, time, torch, random
sys.argv = ["x"]; sys.path.insert(0, "benchmarks")
import rollout_bench as rb, argparse, tempfile
from pathlib import Path
from transformers import AutoModelForCausalLM
a = argparse.Namespace(**rb.PRESETS["cpu"])
torch.manual_seed(0)
tmp = Path(tempfile.mkdtemp())
hf = AutoModelForCausalLM.from_config(rb.hf_config(a)).float(); hf.save_pretrained(tmp)
model, _ = rb.load_hf_folder(tmp, rb.MilesPlugins().registries.model_families)
model.use_kernels(rb.Kernels(rb.MilesPlugins(), "cpu"))
cfg = rb.EngineConfig(max_num_seqs=64, max_model_len=128+256+16, kv_memory_fraction=0.3, max_batched_tokens=16384)
core = rb.EngineCore(model, cfg)
gen = torch.Generator().manual_seed(1)
prompts = torch.randint(1, a.vocab, (64, 128), generator=gen).tolist()
rnd = random.Random(0)
lens = [rnd.randint(32, 256) for _ in range(64)]
def run():
    core.flush_cache()
    reqs = [core.add_request(p, rb.SamplingParams(max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True))[0] for i, (p, n) in enumerate(zip(prompts, lens))]
    while core.has_unfinished(): core.step()
    return sum(len(r.output_ids) for r in reqs)
run()
for _ in range(3):
    t = time.perf_counter(); n = run(); dt = time.perf_counter() - t
    print(f"64 rows, lengths 32-256 (spread like EOS): {n} tokens in {dt*1e3:.0f} ms = {n/dt:.0f} tok/s")
