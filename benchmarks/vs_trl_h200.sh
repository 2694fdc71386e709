#!/usr/bin/env bash
# Miles vs TRL on the H200 (benchmarks/vs_trl.py), from carried wheels and a GGUF carried in parts.
# Staging, here (see docs/real_task.md for the wheel list and the device calls):
#   .whl/small/*.whl   every wheel but pyarrow      .whl/pyarrow/pyarrow-24.0.0-*.whl
#   .whl/gguf/part_aa, part_ab                      split -b 50M SmolLM2-135M-Instruct.Q4_1.gguf .whl/gguf/part_
# Files that earlier calls staged under /root/stage (part_*, small/*.whl) are used as well, since a
# later call's carry list replaces the ignored paths it does not name.
# Extra arguments go to vs_trl.py. Logs and JSON go to $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=/root/stage; mkdir -p $S/small .whl/gguf .whl/small
cp -n .whl/gguf/part_* $S/ 2>/dev/null; cp -n .whl/small/*.whl $S/small/ 2>/dev/null
if [ ! -f /tmp/site/.miles_wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/small/*.whl .whl/pyarrow/*.whl || exit 1
  touch /tmp/site/.miles_wheels
fi
mkdir -p /tmp/smollm2 && cat $S/part_* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
ls -la $S /tmp/smollm2
mkdir -p .pyshim && ln -sfn "$PWD/cli" .pyshim/miles_cli
# miles_nvidia from the checkout, visible to the plugin manager's entry-point scan (Triton kernels on GPU)
d=/tmp/site/miles_nvidia-0.1.0.dist-info; mkdir -p $d
printf 'Metadata-Version: 2.1\nName: miles-nvidia\nVersion: 0.1.0\n' > $d/METADATA
printf '[miles]\nmiles_nvidia = miles_nvidia.plugin\n' > $d/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD:$PWD/.pyshim:$PWD/plugins/miles_nvidia
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, trl, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
python3 benchmarks/vs_trl.py --device cuda --precision bf16 --model /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$@" 2>&1 \
  | grep --line-buffered -v -E "it/s\]|s/it\]" | tee "$OUT/vs_trl.log"
