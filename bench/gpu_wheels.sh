#!/usr/bin/env bash
# The wheels a GPU machine without network lacks for `dwdp serve`, the openai client and nvtx: downloaded
# here for its Python (3.12, x86-64 Linux) into .whl/ (git-ignored), at the versions of constraints.txt.
# On the GPU machine, install them beside its own packages:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Usage (repository root): bench/gpu_wheels.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
# What the GPU image has no copy of (its package list: torch, triton, transformers, httpx, anyio, h11, click,
# prometheus-client, pytest, pytest-timeout, hypothesis, matplotlib, rich are there).
names=(fastapi starlette uvicorn annotated-doc opentelemetry-api openai httpx2 httpcore2 truststore jiter pydantic
       pydantic-core typing-inspection annotated-types sniffio nvtx typing-extensions)
pins=()
for name in "${names[@]}"; do
  pin=$(grep -i -E "^${name//-/[-_]}==" constraints.txt || true)
  pins+=("${pin:-$name}")
done
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_24_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
