#!/usr/bin/env bash
# Fetch, HERE (a machine with the network), the cp312 wheels the lent GPU machine lacks, into .whl/ (git-ignored
# through .git/info/exclude), and print their sizes: what `bench/gpu_session.sh` installs there. The machine has
# torch 2.11, transformers 5.17 and most of the scientific stack, not DeepSpeed, pydantic, orjson, hjson, TRL or
# datasets (tool library device/KINDS.md). `--no-trl` leaves TRL's four wheels out (gpu_perf's trl part then skips).
#   bash bench/gpu_wheels.sh [--no-trl]      # then carry .whl in the device call (bench/README.md, gpu_perf.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" .whl
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          "${platforms[@]}" -d .whl "$@"; }
# Alloy's own needs (the same set the GPU pipeline runs of 2026-11-27 carried), pinned as constraints.txt pins them
get transformers==5.23.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    orjson==3.13.0 hjson==3.1.0
# DeepSpeed ships only a source archive: built here without its C++/CUDA ops (DS_BUILD_OPS=0), a pure-Python wheel
ls .whl/deepspeed-0.19.8-*.whl >/dev/null 2>&1 || \
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
if [ "${1:-}" != "--no-trl" ]; then
  get trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
else
  rm -f .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl
fi
ls -l .whl/*.whl
echo "wheels: $(du -cb .whl/*.whl | tail -1 | cut -f1 | awk '{printf "%.1f MiB", $1 / 1048576}'); TRL's four: $(du -cb .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl 2>/dev/null | tail -1 | cut -f1 | awk '{printf "%.1f MiB", $1 / 1048576}')"
