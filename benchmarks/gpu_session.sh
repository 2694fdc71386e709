#!/usr/bin/env bash
# The H200 runs behind the figures in docs/, batched into few device calls.
#   bash benchmarks/gpu_session.sh nvidia     # miles_nvidia GPU tests + kernel/FP8/batch-invariant benchmarks
#   bash benchmarks/gpu_session.sh train      # torch + Megatron trainer benchmarks, chunked-logprob memory
#   bash benchmarks/gpu_session.sh rollout    # built-in engine vs transformers generate (greedy, sampled, decode_steps 32)
#   bash benchmarks/gpu_session.sh gputests   # every GPU-marked test of the core and miles_nvidia
#   bash benchmarks/gpu_session.sh fp8        # FP8 quantiser/linear tests on the GPU, FP8 linear fwd/fwd+bwd vs bf16, 200-step loss
#   bash benchmarks/gpu_session.sh trainprof  # torch.profiler of one compiled 16k-token train step (Qwen3-0.6B shape)
#   bash benchmarks/gpu_session.sh fp8fused   # the fused transposing FP8 quantisers (MILES_FP8_FUSED_TRANSPOSE=1): byte check, tests, bench
#   bash benchmarks/gpu_session.sh mfu        # torch trainer MFU, compiled, 16k-token micro-batches: varlen vs cudnn attention; profile with cudnn
#   bash benchmarks/gpu_session.sh megatron   # Megatron trainer: GPU tests, MFU (varlen / cudnn / compiled), profile of one step
#   bash benchmarks/gpu_session.sh megdiag    # Megatron trainer, compiled: dynamo's graph breaks and recompiles, MFU; profile of one eager step
#   bash benchmarks/gpu_session.sh fp8both    # (session 5; MILES_FP8_BOTH and its one-read kernel are gone since session 11) FP8 fwd+bwd, one-read vs split dy quantiser
#   bash benchmarks/gpu_session.sh engprof    # engine decode at batch 64: profile by kernel kind; decode_parts.py (attention variants, GEMMs)
#   bash benchmarks/gpu_session.sh engine2    # rollout GPU tests; rollout bench (default, and --no-splitk); engine profile; decode_parts.py
#   bash benchmarks/gpu_session.sh final8     # rollout GPU tests, FP8 tests; rollout bench (default; decode_steps 32); FP8 tables and 200-step loss
#   bash benchmarks/gpu_session.sh s9a      # rollout GPU tests, rollout bench, engine profile at 64; the FP8 backward's parts alone (bench_nvidia --only parts)
#   bash benchmarks/gpu_session.sh s9b      # rollout + FP8 GPU tests; rollout bench (prefix cache flushed), decode_steps 32; engine profiles at 64 and 1; FP8 tables and parts
#   bash benchmarks/gpu_session.sh s9c      # FP8 GPU tests incl. MILES_FP8_WGRAD=blocks; FP8 tables and 200-step loss in that mode; rollout bench again
#   bash benchmarks/gpu_session.sh s9d      # split-K vs cuBLAS for all four decode GEMMs at 64 rows; 200-step FP8 loss, wgrad tiles vs blocks
#   bash benchmarks/gpu_session.sh s9e      # FP8 GEMM GPU tests; the rewritten Triton FP8 GEMM's wgrad sweep; fwd+bwd with its best launch as the wgrad
#   bash benchmarks/gpu_session.sh s9f      # rollout GPU tests; rollout bench with the gated gate/up GEMM (default) and without; engine profile at 64
#   bash benchmarks/gpu_session.sh s9g      # FP8 MILES_FP8_WGRAD=dy_blocks: GPU tests, the wgrad GEMM alone, fwd+bwd and the 200-step loss
#   bash benchmarks/gpu_session.sh s10a     # as s10d below (run before PDL was limited to <= 64 rows; that call also profiled the engine at 64)
#   bash benchmarks/gpu_session.sh s10b     # FP8 GPU tests; FP8 tables by wgrad mode and the parts; the 200-step loss over 16 seeds
#   bash benchmarks/gpu_session.sh s10c     # FP8 GPU tests and fwd+bwd tables with the blocks default; engine with PDL + prefetch, PDL alone, neither, and again
#   bash benchmarks/gpu_session.sh s11a     # FP8 GPU tests; fwd+bwd against bf16 in interleaved rounds by variant (ran with the tile kernel and the Markstein division, both removed since)
#   bash benchmarks/gpu_session.sh s11b     # as s11a, with the final code (the default quantisers only)
#   bash benchmarks/gpu_session.sh s11c     # engine at batch 256 after HF, without HF before it, and without HF at all (the session-10 gap)
#   bash benchmarks/gpu_session.sh s12a     # rollout GPU tests; prologue + attention vs the fused kernel alone; engine with / without overlapped windows and the fused attention
#   bash benchmarks/gpu_session.sh s12b     # (ran with the pipelined attention loop and folded norms, both removed since: their flags are gone) attention launches; engine by launch
#   bash benchmarks/gpu_session.sh s12c     # rollout bench with HF; engine without overlap, with folded norms (--fold-norms is gone since); rollout GPU tests
#   bash benchmarks/gpu_session.sh s13a     # rollout bench with HF (final session-12 code); engine profiles (kinds, GPU timeline) at batch 64 and 1; sampler launches
#   bash benchmarks/gpu_session.sh s13b     # rollout GPU tests; rollout bench with HF; engine: this code, call 4's (.baseline/), without sampling in the step graph, alternated
#   bash benchmarks/gpu_session.sh s13c     # rollout GPU tests; rollout bench with HF (the final session-13 code)
#   bash benchmarks/gpu_session.sh s14      # the same, shorter (batch 64 first): for a session with ~6 min of device time
#   bash benchmarks/gpu_session.sh s24      # rollout GPU tests; on an H200 only, the rollout bench with HF at 64, 1, 256
#   bash benchmarks/gpu_session.sh s25      # s24 with the algorithm and weight-sync GPU tests too
#   bash benchmarks/gpu_session.sh s26      # on an H200 the rollout bench with HF at 64, 1, 256 first, then s25's GPU tests
#   bash benchmarks/gpu_session.sh h200only s26   # stop at once (exit 3) unless the card is an H200: a cheap probe for one
#   bash benchmarks/gpu_session.sh h200only s26b  # the rollout bench with HF at 64, 1, 256 alone, on an H200 (a short budget)
#   bash benchmarks/gpu_session.sh h200only s26c  # the rollout bench with HF at batch 64 alone, on an H200 (the last minutes)
#   bash benchmarks/gpu_session.sh s27      # on an H200 the bench with HF at 64, 1, 256 (and at 64 with the split); split GPU tests; the engine
#                                           # alone at 64 and 256 with and without two-stream half-batches, alternated twice
#   bash benchmarks/gpu_session.sh s27b     # s27 with the H200 bench at batch 64 only (a short budget)
#   bash benchmarks/gpu_session.sh s25b     # short s25: the engine and algorithm GPU tests; on an H200 the bench at 64, 256
#   bash benchmarks/gpu_session.sh s25c     # shortest: the update/release/resume GPU test; on an H200 the bench at 64
#   bash benchmarks/gpu_session.sh s24b     # the update/release/resume GPU test; on an H200 only, the rollout bench with HF at 64, 256
#   bash benchmarks/gpu_session.sh s18      # s14 without batch 1 (rollout GPU tests; batch 64 and 256 with HF)
#   bash benchmarks/gpu_session.sh s16      # the engine's transformers path (transformers_runner.py) against HF generate at batch 1 and 64
#   bash benchmarks/gpu_session.sh s14 s15a # s14, then batch 64 with HF once more (HF's spread), at 16 and 32 decode steps per sync, and the engine's profile at 64 over 256 new tokens
#   bash benchmarks/gpu_session.sh s10d     # rollout GPU tests; rollout bench (PDL at <= 64 rows, the default) with HF, and --no-pdl
#   bash benchmarks/gpu_session.sh fp8check   # the FP8 quantiser / module-gradient / path tests under the default (fused activation) kernels
#   bash benchmarks/gpu_session.sh sync       # weight sync to a GPU `miles serve` (NCCL needs 2 GPUs: nvidia-h200-x2)
# Logs and JSON go to $OUT (the device tool brings them back).
set -u -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p .pyshim && ln -sfn "$PWD/cli" .pyshim/miles_cli
# miles_nvidia from the checkout, visible to the plugin manager's entry-point scan (its kernels in
# the trainer and the engine), as a pip install would make it
d=/tmp/site/miles_nvidia-0.1.0.dist-info; mkdir -p $d
printf 'Metadata-Version: 2.1\nName: miles-nvidia\nVersion: 0.1.0\n' > $d/METADATA
printf '[miles]\nmiles_nvidia = miles_nvidia.plugin\n' > $d/entry_points.txt
export PYTHONPATH=$PWD:$PWD/.pyshim:$PWD/plugins/miles_nvidia:/tmp/site
# megatron-core 0.19.2 (cp312) carried in .whl/ or .whl/mc/, or staged by an earlier call on this machine
install_megatron() {
  mkdir -p /root/stage/mc && cp -n .whl/megatron_core-*.whl .whl/mc/megatron_core-*.whl /root/stage/mc/ 2>/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /root/stage/mc/megatron_core-*.whl
}
# the rollout bench with HF at batches $1, only on an H200 (the issue's card): its figures are not comparable elsewhere
# (extra arguments go to rollout_bench.py; the log is named after them)
bench_on_h200() {
  local b=$1; shift
  local tag=""; [ $# -gt 0 ] && tag="_$(printf %s "$*" | tr -c 'a-z0-9' _)"
  local log="$OUT/rollout_bench_hf$tag.log"
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H200*) OUT= timeout 200 python3 benchmarks/rollout_bench.py --preset gpu --batches "$b" "$@" 2>&1 | tee "$log" | tail -6 ;;
    *) echo "not an H200: the rollout bench is skipped" ;;
  esac
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for part in "$@"; do
  case $part in
    nvidia)
      python3 -m pytest -q plugins/miles_nvidia/tests -m gpu 2>&1 | tee "$OUT/nvidia_tests.log" | tail -15
      python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py 2>&1 | tee "$OUT/nvidia_bench.log" ;;
    train)
      if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
      fi
      python3 -m pytest -q tests/test_trainer_gpu.py tests/megatron -m gpu 2>&1 | tee "$OUT/train_tests.log" | tail -15
      python3 benchmarks/logprob_memory.py --device cuda 2>&1 | tee "$OUT/logprob_memory.log" | tail -12
      python3 benchmarks/train_bench.py --preset qwen3-0.6b --device cuda --steps 5 --warmup 2 --no-memory-table 2>&1 | tee "$OUT/train_bench_torch.log" | tail -12
      python3 benchmarks/train_bench.py --preset qwen3-0.6b --device cuda --steps 5 --warmup 2 --no-memory-table --backend megatron 2>&1 | tee "$OUT/train_bench_megatron.log" | tail -12 ;;
    gputests)
      python3 -m pytest -q -rf --tb=short -m gpu tests/rollout tests/test_trainer_gpu.py tests/algorithms/test_gpu.py plugins/miles_nvidia/tests 2>&1 \
        | tee "$OUT/gpu_tests.log" | grep -v "^\s*$" | tail -40
      # the logprob kernel's tests take the device fixture: all of them run on CUDA here
      python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_logprobs_kernel.py 2>&1 | tee "$OUT/logprob_kernel_tests.log" | tail -6 ;;
    rollout)
      python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -8
      python3 benchmarks/rollout_bench.py --preset gpu --batches 64,256 --temperature 1.0 2>&1 | tee "$OUT/rollout_bench_t1.log" | tail -6
      OUT=$OUT/ds32 python3 benchmarks/rollout_bench.py --preset gpu --batches 64,256 --skip-hf --decode-steps 32 2>&1 | tee "$OUT/rollout_bench_ds32.log" | tail -6 ;;
    fp8)
      python3 -m pytest -q -rfP plugins/miles_nvidia/tests/test_nv_fp8.py -k "gpu or bitwise or layouts or sm90 or reference" 2>&1 | tee "$OUT/fp8_tests.log" | tail -16
      python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8,loss 2>&1 | tee "$OUT/fp8_bench.log" ;;
    fp8fused)
      MILES_FP8_FUSED_TRANSPOSE=1 python3 -m pytest -q -s -rf plugins/miles_nvidia/tests/test_nv_fp8.py -k "gpu" 2>&1 | tee "$OUT/fp8fused_tests.log" | grep -E "differing bytes|passed|failed|FAILED"
      MILES_FP8_FUSED_TRANSPOSE=1 OUT=/tmp/fused python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8 2>&1 | tee "$OUT/fp8fused_bench.log" | tail -14 ;;
    mfu)
      for att in varlen cudnn; do
        mkdir -p /tmp/$att && OUT=/tmp/$att python3 benchmarks/train_bench.py --preset qwen3-0.6b --device cuda --steps 4 --warmup 2 --no-memory-table \
          --micro-batch-tokens 16384 train.compile=true train.attention=$att 2>&1 | tee "$OUT/train_bench_$att.log" | tail -4
      done
      python3 benchmarks/profile_gpu.py train train.compile=true train.max_tokens_per_micro_batch=16384 train.attention=cudnn 2>&1 \
        | tee "$OUT/profile_train_cudnn.log" | grep -E "^train:|Self CUDA time total" ;;
    megatron)
      install_megatron
      python3 -m pytest -q -rf --tb=short tests/megatron -m gpu 2>&1 | tee "$OUT/megatron_tests.log" | tail -4
      for att in varlen cudnn; do
        mkdir -p /tmp/m$att && OUT=/tmp/m$att python3 benchmarks/train_bench.py --backend megatron --preset qwen3-0.6b --device cuda --steps 4 \
          --warmup 2 --no-memory-table --micro-batch-tokens 16384 train.attention=$att 2>&1 | tee "$OUT/megatron_bench_$att.log" | tail -2
      done
      timeout 200 python3 benchmarks/train_bench.py --backend megatron --preset qwen3-0.6b --device cuda --steps 4 --warmup 2 --no-memory-table \
        --micro-batch-tokens 16384 train.attention=cudnn train.compile=true 2>&1 | tee "$OUT/megatron_bench_compile.log" | tail -2
      python3 benchmarks/profile_gpu.py train --backend megatron train.max_tokens_per_micro_batch=16384 train.attention=cudnn 2>&1 \
        | tee "$OUT/megatron_profile.log" | grep -E "^train:|Self CUDA time total" ;;
    megdiag)
      install_megatron
      TORCH_LOGS=graph_breaks,recompiles timeout 300 python3 benchmarks/train_bench.py --backend megatron --preset qwen3-0.6b --device cuda --steps 3 \
        --warmup 2 --no-memory-table --micro-batch-tokens 16384 train.attention=cudnn train.compile=true 2>&1 | tee "$OUT/megatron_breaks.log" | tail -2
      python3 benchmarks/profile_gpu.py train --backend megatron train.max_tokens_per_micro_batch=16384 train.attention=cudnn 2>&1 \
        | tee "$OUT/megatron_profile.log" | grep -E "^train:|Self CUDA time total" ;;
    fp8both)
      python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_fp8.py -k "bitwise" 2>&1 | tee "$OUT/fp8both_tests.log" | tail -3
      MILES_FP8_BOTH=fused OUT=/tmp/fused1 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8 2>&1 | tee "$OUT/fp8both_fused.log" | tail -26
      OUT=/tmp/split python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8 2>&1 \
        | tee "$OUT/fp8both_split.log" | grep -A12 "forward+backward" ;;
    engprof)
      python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -4
      python3 benchmarks/profile_gpu.py engine --batch 64 --new-tokens 256 --no-fused 2>&1 | tee "$OUT/profile_engine64_unfused.log" | grep -A14 -E "^engine:|kernel kind"
      python3 benchmarks/profile_gpu.py engine --batch 64 --new-tokens 256 2>&1 | tee "$OUT/profile_engine64.log" | grep -A14 -E "^engine:|kernel kind"
      OUT=$OUT/rb python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6
      python3 benchmarks/decode_parts.py 2>&1 | tee "$OUT/decode_parts.log" | grep -E "batch [0-9]+:|best|current default|^ *(64|256) +(qkv|o|gate_up|down|lm_head)" ;;
    engine2)
      python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -4
      OUT=$OUT/rb timeout 200 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6
      OUT=$OUT/rbk timeout 100 python3 benchmarks/rollout_bench.py --preset gpu --batches 64,256 --skip-hf --no-splitk 2>&1 | tee "$OUT/rollout_bench_nosplitk.log" | tail -4
      timeout 60 python3 benchmarks/profile_gpu.py engine --batch 64 --new-tokens 256 2>&1 | tee "$OUT/profile_engine64.log" | grep -A14 -E "^engine:|kernel kind"
      timeout 200 python3 benchmarks/decode_parts.py 2>&1 | tee "$OUT/decode_parts.log" | grep -E "batch [0-9]+:|best|current default|^ *(64|256) +(qkv|o|gate_up|down|lm_head) " ;;
    final8)
      timeout 60 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -3
      timeout 60 python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_fp8.py -k "bitwise or module_grads or gpu_paths" 2>&1 | tee "$OUT/fp8_tests.log" | tail -3
      OUT=$OUT/rb timeout 150 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6
      OUT=$OUT/ds32 timeout 60 python3 benchmarks/rollout_bench.py --preset gpu --batches 64,256 --skip-hf --decode-steps 32 2>&1 | tee "$OUT/rollout_bench_ds32.log" | tail -3
      OUT=$OUT/fp8 timeout 170 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8,loss 2>&1 | tee "$OUT/fp8_bench.log" | grep -A11 -E "forward\+backward|200|loss" | head -40 ;;
    s9a)
      timeout 90 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -3
      OUT=$OUT/rb timeout 150 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6
      timeout 60 python3 benchmarks/profile_gpu.py engine --batch 64 --new-tokens 256 2>&1 | tee "$OUT/profile_engine64.log" | grep -A14 -E "^engine:|kernel kind"
      OUT=$OUT/parts timeout 200 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only parts 2>&1 | tee "$OUT/fp8_parts.log" | tail -60 ;;
    s9b)
      timeout 90 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -3
      timeout 90 python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_fp8.py -k "bitwise or module_grads or gpu_paths" 2>&1 | tee "$OUT/fp8_tests.log" | tail -3
      OUT=$OUT/rb timeout 150 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6
      OUT=$OUT/ds timeout 60 python3 benchmarks/rollout_bench.py --preset gpu --batches 64 --skip-hf --decode-steps 32 2>&1 | tee "$OUT/rollout_bench_ds32.log" | tail -2
      for b in 64 1; do
        timeout 60 python3 benchmarks/profile_gpu.py engine --batch $b --new-tokens 256 2>&1 | tee "$OUT/profile_engine$b.log" | grep -A14 -E "^engine:|kernel kind"
      done
      OUT=$OUT/fp8 timeout 200 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8,parts 2>&1 | tee "$OUT/fp8_bench.log" | grep -A13 -E "forward\+backward|GEMMs \(" | head -60 ;;
    s9c)
      timeout 120 python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_fp8.py -k "bitwise or module_grads or gpu_paths or blocks" 2>&1 | tee "$OUT/fp8_tests.log" | tail -3
      MILES_FP8_WGRAD=blocks OUT=$OUT/blocks timeout 200 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8,loss 2>&1 | tee "$OUT/fp8_blocks_bench.log" | grep -A11 -E "forward\+backward|200|loss" | head -40
      OUT=$OUT/rb timeout 150 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6 ;;
    s9d)
      timeout 200 python3 benchmarks/decode_parts.py --batches 64 --parts splitk --splitk-shapes qkv,gate_up,o,down 2>&1 | tee "$OUT/decode_parts_splitk.log" | grep -E "cuBLAS|best"
      for mode in tiles blocks; do
        MILES_FP8_WGRAD=$mode OUT=$OUT/loss_$mode timeout 60 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only loss 2>&1 | tee "$OUT/loss_$mode.log" | grep -A5 "200 steps"
      done ;;
    s9e)
      timeout 120 python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_fp8.py -k "gpu_paths or module_grads or auto_gemm" 2>&1 | tee "$OUT/fp8_gemm_tests.log" | tail -3
      OUT=$OUT/parts timeout 200 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only parts 2>&1 | tee "$OUT/fp8_parts.log" | grep -E "wgrad|fwd|dgrad" | head -60
      best=$(python3 -c "
import json; rows = json.load(open('$OUT/parts/bench_nvidia.json'))['parts']['gemms']
t = [(float(r[2]), r[1].split('triton ')[1]) for r in rows if r[0] == '8B gate_up' and 'wgrad triton' in r[1] and r[2][0].isdigit()]
print(min(t)[1].strip('()').replace(' ', '') if t else '')")
      echo "best Triton wgrad launch for 8B gate_up: $best"
      [ -n "$best" ] && MILES_FP8_WGRAD_GEMM=triton:$best OUT=$OUT/tw timeout 120 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8 2>&1 \
        | tee "$OUT/fp8_triton_wgrad.log" | grep -A11 "forward+backward" ;;
    s9f)
      timeout 120 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -3
      OUT=$OUT/rb timeout 170 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6
      OUT=$OUT/rbg timeout 90 python3 benchmarks/rollout_bench.py --preset gpu --batches 1,64,256 --skip-hf --no-gated 2>&1 | tee "$OUT/rollout_bench_nogated.log" | tail -4
      timeout 60 python3 benchmarks/profile_gpu.py engine --batch 64 --new-tokens 256 2>&1 | tee "$OUT/profile_engine64.log" | grep -A14 -E "^engine:|kernel kind" ;;
    s9g)
      timeout 60 python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_fp8.py -k "a_in_blocks or module_grads" 2>&1 | tee "$OUT/fp8_tests.log" | tail -3
      OUT=$OUT/parts timeout 60 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only parts 2>&1 | tee "$OUT/fp8_parts.log" | grep -E "wgrad \(scaled|blocks" | head -12
      MILES_FP8_WGRAD=dy_blocks OUT=$OUT/dyb timeout 80 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8,loss 2>&1 | tee "$OUT/fp8_dy_blocks.log" | grep -A11 -E "forward\+backward|200 steps" | grep -E "8B|fp8|bf16" | head -16 ;;
    s10b)
      timeout 90 python3 -m pytest -q -rf --tb=short -m gpu plugins/miles_nvidia/tests/test_nv_fp8.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -3
      OUT=$OUT/fp8 timeout 150 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8,parts 2>&1 | tee "$OUT/fp8_bench.log" \
        | grep -A6 -E "by weight-gradient" | head -8
      grep -E "quantise x|wgrad, x in|wgrad \(scaled" "$OUT/fp8_bench.log" | head -24
      OUT=$OUT/loss timeout 300 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only loss --seeds 16 2>&1 | tee "$OUT/loss.log" | tail -9 ;;
    s11a|s11b)
      timeout 150 python3 -m pytest -q -rf --tb=short -m gpu plugins/miles_nvidia/tests/test_nv_fp8.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -4
      OUT=$OUT/fp8 timeout 240 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8 2>&1 | tee "$OUT/fp8_bench.log" \
        | grep -A70 -E "interleaved rounds" | grep -E "8B|shape|##" ;;
    s13b)
      timeout 200 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -4
      OUT= timeout 150 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench_hf.log" | tail -5
      # base: the code of call 4 (commit 1ca9265, carried as .baseline/), run the same way in the same call
      for v in "new:" "base:" "nogs:--no-graph-sampling" "new2:" "base2:"; do
        dir=.; pp=$PYTHONPATH; [ "${v%%:*}" = base ] || [ "${v%%:*}" = base2 ] && { dir=.baseline; pp=$PWD/.baseline:$PWD/.pyshim:$PWD/.baseline/plugins/miles_nvidia:/tmp/site; }
        OUT= PYTHONPATH=$pp timeout 100 python3 $dir/benchmarks/rollout_bench.py --preset gpu --batches 1,64,256 --skip-hf ${v#*:} 2>&1 \
          | tee "$OUT/rollout_bench_${v%%:*}.log" | grep -E "^ +(1|64|256) \|" | tr '\n' ' '; echo " <- ${v%%:*}"
      done ;;
    s24)
      timeout 180 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -6
      bench_on_h200 64,1,256 ;;
    h200only)
      nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: stopping"; exit 3; } ;;
    s26c)
      bench_on_h200 64 ;;
    s27|s27b)
      if [ "$part" = s27 ]; then bench_on_h200 64,1,256; else bench_on_h200 64; fi
      timeout 120 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout/test_gpu_engine.py -k "split or fused_layer" 2>&1 | tee "$OUT/split_tests.log" | tail -4
      # the engine alone with and without the two-stream half-batches, alternated twice (same card, same process kind)
      for r in 1 2; do
        for sp in 0 2; do
          mkdir -p "$OUT/split$sp-$r" && OUT=$OUT/split$sp-$r timeout 150 python3 benchmarks/rollout_bench.py --preset gpu --batches 64,256 \
            --skip-hf --split-decode $sp 2>&1 | tee "$OUT/split$sp-$r/bench.log" | grep '^{' | cut -c1-90 | sed "s/^/split $sp run $r: /"
        done
      done
      # PDL chains kernels within a stream: the halves without it, once
      mkdir -p "$OUT/split2-nopdl" && OUT=$OUT/split2-nopdl timeout 150 python3 benchmarks/rollout_bench.py --preset gpu --batches 64,256 \
        --skip-hf --split-decode 2 --no-pdl 2>&1 | tee "$OUT/split2-nopdl/bench.log" | grep '^{' | cut -c1-90 | sed "s/^/split 2 no pdl: /"
      bench_on_h200 64 --split-decode 2 ;;  # the issue's comparison with the halves, on an H200
    s26b)
      bench_on_h200 64,1,256 ;;
    s26)
      bench_on_h200 64,1,256
      timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout tests/algorithms/test_gpu.py tests/sync 2>&1 | tee "$OUT/gpu_tests.log" | tail -6 ;;
    s25)
      timeout 300 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout tests/algorithms/test_gpu.py tests/sync 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
      bench_on_h200 64,1,256 ;;
    s25b)
      timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout/test_gpu_engine.py tests/algorithms/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
      bench_on_h200 64,256 ;;
    s25c)
      timeout 60 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout/test_gpu_engine.py -k fresh_engine 2>&1 | tee "$OUT/fresh_engine_test.log" | tail -3
      bench_on_h200 64 ;;
    s24b)
      timeout 90 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout/test_gpu_engine.py -k fresh_engine 2>&1 | tee "$OUT/fresh_engine_test.log" | tail -4
      bench_on_h200 64,256 ;;
    s14)
      timeout 60 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -4
      OUT= timeout 200 python3 benchmarks/rollout_bench.py --preset gpu --batches 64,1,256 2>&1 | tee "$OUT/rollout_bench_hf.log" | tail -6 ;;
    s18)  # s14 without batch 1: for a session with ~5 min of device time
      timeout 60 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -4
      OUT= timeout 150 python3 benchmarks/rollout_bench.py --preset gpu --batches 64,256 2>&1 | tee "$OUT/rollout_bench_hf.log" | tail -5 ;;
    s16)  # the transformers path (architectures with no Miles family) on the same model, with HF
      OUT= timeout 150 python3 benchmarks/rollout_bench.py --preset gpu --batches 1,64 --transformers-path 2>&1 | tee "$OUT/rollout_bench_tfpath.log" | tail -5 ;;
    s15a)  # after s14 (`gpu_session.sh s14 s15a`): its tests and table first
      OUT= timeout 100 python3 benchmarks/rollout_bench.py --preset gpu --batches 64 2>&1 | tee "$OUT/rollout_bench_hf64b.log" | tail -3
      for k in 16 32; do OUT= timeout 60 python3 benchmarks/rollout_bench.py --preset gpu --batches 64 --skip-hf --decode-steps $k 2>&1 | tail -1; done | tee "$OUT/rollout_bench_ds.log"
      timeout 100 python3 benchmarks/profile_gpu.py engine --batch 64 --new-tokens 256 2>&1 | tee "$OUT/profile_engine64.log" | grep -A20 "kernel kind" ;;
    s13c)
      timeout 100 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -4
      OUT= timeout 170 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench_hf.log" | tail -5 ;;
    s13a)
      OUT= timeout 150 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench_hf.log" | tail -6
      timeout 120 python3 benchmarks/profile_gpu.py engine --batch 64 2>&1 | tee "$OUT/profile_engine64.log" | grep -A40 "kernel kind"
      timeout 100 python3 benchmarks/profile_gpu.py engine --batch 1 2>&1 | tee "$OUT/profile_engine1.log" | grep -A40 "kernel kind"
      timeout 120 python3 benchmarks/decode_parts.py --parts sampler --batches 1,64,256 2>&1 | tee "$OUT/decode_parts_sampler.log" | grep -E "best|engine" ;;
    s12a)
      timeout 200 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -4
      timeout 60 python3 benchmarks/decode_parts.py --parts prologue --batches 1,64,256 2>&1 | tee "$OUT/decode_parts_prologue.log" | tail -5
      timeout 120 python3 benchmarks/decode_parts.py --parts launches --batches 64 2>&1 | tee "$OUT/decode_parts_launches.log" | grep -E "best|\*"
      for v in "def:" "noov:--no-overlap" "nofa:--no-fused-attention" "def2:" "noov2:--no-overlap"; do
        OUT= timeout 100 python3 benchmarks/rollout_bench.py --preset gpu --batches 1,64,256 --skip-hf ${v#*:} 2>&1 \
          | tee "$OUT/rollout_bench_${v%%:*}.log" | grep -E "^ +(1|64|256) \|" | tr '\n' ' '; echo " <- ${v%%:*}"
      done ;;
    s12b)
      timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -3
      timeout 200 python3 benchmarks/decode_parts.py --parts attention --attention-batches 64,256 2>&1 | tee "$OUT/decode_parts_attention.log" | grep -E "best|session-11|WRONG"
      for v in "s11:--attention 64,4,0,1 --no-fold-norms" "def:" "nofold:--no-fold-norms" "p16:--attention 16,4,1,1"; do
        OUT= timeout 100 python3 benchmarks/rollout_bench.py --preset gpu --batches 1,64,256 --skip-hf ${v#*:} 2>&1 \
          | tee "$OUT/rollout_bench_${v%%:*}.log" | grep -E "^ +(1|64|256) \|" | tr '\n' ' '; echo " <- ${v%%:*}"
      done ;;
    s12c)
      OUT= timeout 130 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench_hf.log" | tail -5
      for v in "noov:--no-overlap" "fold:--fold-norms"; do
        OUT= timeout 50 python3 benchmarks/rollout_bench.py --preset gpu --batches 1,64,256 --skip-hf ${v#*:} 2>&1 \
          | tee "$OUT/rollout_bench_${v%%:*}.log" | grep -E "^ +(1|64|256) \|" | tr '\n' ' '; echo " <- ${v%%:*}"
      done
      timeout 60 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -3 ;;
    s11c)
      for v in "hf64_256:--batches 64,256" "hf256:--batches 256" "skip:--batches 64,256 --skip-hf" "hf64_256b:--batches 64,256"; do
        OUT=$OUT/rb_${v%%:*} timeout 150 python3 benchmarks/rollout_bench.py --preset gpu ${v#*:} 2>&1 \
          | tee "$OUT/rollout_bench_${v%%:*}.log" | grep -E "^ +(64|256) \|"
      done ;;
    s10c)
      timeout 90 python3 -m pytest -q -rf --tb=short -m gpu plugins/miles_nvidia/tests/test_nv_fp8.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -3
      OUT=$OUT/fp8 timeout 120 python3 plugins/miles_nvidia/benchmarks/bench_nvidia.py --only fp8 2>&1 | tee "$OUT/fp8_bench.log" \
        | grep -A12 -E "by weight-gradient" | grep -E "8B|shape"
      for v in "pf:" "nopf:--no-prefetch" "nopdl:--no-pdl" "pf2:"; do
        OUT=$OUT/rb_${v%%:*} timeout 100 python3 benchmarks/rollout_bench.py --preset gpu --batches 1,64,256 --skip-hf ${v#*:} 2>&1 \
          | tee "$OUT/rollout_bench_${v%%:*}.log" | grep -E "^engine:|^ +(1|64|256) \|"
      done ;;
    s10a|s10d)  # s10a ran before PDL was limited to <= 64 rows
      timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/rollout 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -3
      OUT=$OUT/rb timeout 200 python3 benchmarks/rollout_bench.py --preset gpu 2>&1 | tee "$OUT/rollout_bench.log" | tail -6
      OUT=$OUT/rbn timeout 100 python3 benchmarks/rollout_bench.py --preset gpu --batches 1,64,256 --skip-hf --no-pdl 2>&1 \
        | tee "$OUT/rollout_bench_nopdl.log" | tail -4 ;;
    fp8check)
      python3 -m pytest -q -rf --tb=short plugins/miles_nvidia/tests/test_nv_fp8.py -k "gpu_quantisers_bitwise or module_grads or gpu_paths" 2>&1 \
        | tee "$OUT/fp8check_tests.log" | tail -4 ;;
    trainprof)
      python3 benchmarks/profile_gpu.py train train.compile=true train.max_tokens_per_micro_batch=16384 2>&1 \
        | tee "$OUT/profile_train_compile.log" | grep -E "^train:|Self CUDA time total" ;;
    sync)
      python3 -m pytest -q -rs tests/sync/test_transports_gpu.py -m gpu 2>&1 | tee "$OUT/sync_tests.log" | tail -8
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        python3 benchmarks/weight_sync_bench.py --device cuda:0 --engine-device cuda:1 2>&1 | tee "$OUT/weight_sync_bench.log" | tail -12
      else
        python3 benchmarks/weight_sync_bench.py --device cuda --dist-backend gloo 2>&1 | tee "$OUT/weight_sync_bench.log" | tail -12
      fi ;;
  esac
done
