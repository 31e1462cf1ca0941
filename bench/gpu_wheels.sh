#!/usr/bin/env bash
# Everything a GPU machine without network needs carried for the GPU checks, in one step, into two git-ignored
# folders of this checkout:
#   .whl/  the wheels the GPU image lacks for `dwdp serve`, the openai client and nvtx (gpu_check section h; the
#          --quick check needs none of them), for its Python (3.12, x86-64 Linux), at constraints.txt's versions;
#   .gpu/  ../shared/gpu/probe_vmm.py (the cuMem probe; ../shared does not travel to the GPU machine).
# Then, on the GPU machine (the device tool: carry [".whl", ".gpu"]), the one command:
#   python3 -m pip install -q --no-deps --no-build-isolation -e . && \
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; \
#   python3 bench/gpu_check.py --quick; python3 .gpu/probe_vmm.py bench/results/probe_vmm_<gpu>.json
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
for folder in .whl .gpu; do
  grep -qxF "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude
done
mkdir -p .whl .gpu
if [ -f ../shared/gpu/probe_vmm.py ]; then
  cp ../shared/gpu/probe_vmm.py .gpu/
else
  echo "../shared/gpu/probe_vmm.py not found: .gpu/ holds no probe" >&2
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_24_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl .gpu
