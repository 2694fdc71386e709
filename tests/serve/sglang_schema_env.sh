#!/usr/bin/env bash
# Build the folder that test_sglang_schema.py imports SGLang's own request schemas from (CPU, no CUDA):
# sglang 0.5.23 without its dependencies, the light packages its io_struct import chain needs, and a
# stand-in for torchvision (whose real wheel needs a matching torch build). About 1 minute, ~100 MB.
#   bash tests/serve/sglang_schema_env.sh /tmp/sglang-schema
#   MILES_SGLANG_PATH=/tmp/sglang-schema python -m pytest -q tests/serve/test_sglang_schema.py
set -euo pipefail
dir=${1:-/tmp/sglang-schema}
mkdir -p "$dir/site" "$dir/stub/torchvision/transforms"
python -m pip install -q --no-deps --target "$dir/site" sglang==0.5.23 orjson pybase64 starlette msgspec pyzmq ipython \
  traitlets aiohttp multidict yarl propcache aiohappyeyeballs aiosignal frozenlist dill apache-tvm-ffi sentencepiece \
  compressed-tensors loguru openai sniffio partial-json-parser
printf '__version__ = "0.0.0-stand-in"\n' > "$dir/stub/torchvision/__init__.py"
printf 'import enum\n\n\nclass InterpolationMode(enum.Enum):\n    NEAREST = "nearest"\n    BILINEAR = "bilinear"\n    BICUBIC = "bicubic"\n' \
  > "$dir/stub/torchvision/transforms/__init__.py"
printf 'from torchvision.transforms import InterpolationMode  # noqa: F401\n' > "$dir/stub/torchvision/transforms/functional.py"
echo "MILES_SGLANG_PATH=$dir"
