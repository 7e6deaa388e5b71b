#!/usr/bin/env bash
# A CUDA learner's checks, for the GPU device machine (issue 15's targets), in two parts that each
# fit one device run of under 10 minutes:
#   tests  tests/test_cuda.py: graphed steps match eager ones, pushes and batches cross intact,
#          a checkpoint moves GPU -> CPU -> GPU (about 4 minutes, compiles included)
#   bench  python -m benchmarks --only learner --device cuda: update steps beside the CleanRL
#          anchor, the push beside the pinned copy, SAC HalfCheetah 100k frames GPU beside CPU
#          (about 8 minutes)
# Here, once, from the repository root: bash ../shared/device/wheels.sh --mujoco
# Then a device run per part (carry [".whl"]): bash benchmarks/device_check.sh tests   (then: bench)
# A dry run on a CPU machine: python -m benchmarks --only learner --quick (and pytest skips test_cuda.py).
set -uo pipefail
part=${1:?usage: bash benchmarks/device_check.sh tests|bench}
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD/.site:$PWD
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline MUJOCO_GL=egl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
case "$part" in
  tests) timeout 560 python3 -m pytest -q -p no:cacheprovider -o timeout=0 tests/test_cuda.py 2>&1 \
           | tee "$out/device_tests.log" ;;
  bench) timeout 560 python3 -m benchmarks --only learner --device cuda --compare none \
           --json "$out/learner_cuda.json" 2>&1 | tee "$out/device_bench.log" ;;
  *) echo "unknown part $part (tests or bench)" >&2; exit 2 ;;
esac
