#!/usr/bin/env bash
# A CUDA learner's checks, for the GPU device machine (issue 15's targets), in two parts that each
# fit one device run of under 10 minutes:
#   tests  tests/test_cuda.py: graphed steps match eager ones, pushes and batches cross intact,
#          a checkpoint moves GPU -> CPU -> GPU (about 4 minutes, compiles included)
#   bench  python -m benchmarks --only learner --device cuda: update steps beside the CleanRL
#          anchor, the push beside the pinned copy, SAC HalfCheetah 100k frames GPU beside CPU
#          (about 8 minutes)
#   llm    the language-model learner on the GPU (device=auto picks it): tests/test_grpo.py (GRPO learns
#          the tiny model's task) and tests/test_llm_failures.py (the NaN guard and failures outside the
#          learner), then one short run per model.dtype (at most 7 minutes)
# Here, once, from the repository root: bash ../shared/device/wheels.sh --mujoco; for llm also transformers
# and what it imports, as wheels for the device's Python 3.12 (bash benchmarks/device_check.sh wheels)
# Then a device run per part (carry [".whl"]): bash benchmarks/device_check.sh tests   (then: bench, llm)
# A dry run on a CPU machine: python -m benchmarks --only learner --quick (and pytest skips test_cuda.py).
set -uo pipefail
part=${1:?usage: bash benchmarks/device_check.sh tests|bench|llm|wheels}
if [ "$part" = wheels ]; then  # here, not there: transformers 5 and its imports, for Python 3.12 x86-64
  plat=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl transformers==5.19.0 tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors==0.8.0 \
    regex==2026.5.9 filelock fsspec hf-xet httpx2 httpcore2 h11 anyio idna sniffio truststore typing-extensions \
    typer click annotated-doc shellingham pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection
fi
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
  llm) timeout 240 python3 -m pytest -q -p no:cacheprovider -o timeout=0 tests/test_grpo.py \
           tests/test_llm_failures.py 2>&1 | tee "$out/device_llm_tests.log"
       for dtype in float32 bfloat16 float16; do  # docs/language-models.md's first GRPO command, shortened, per dtype
         timeout 60 python3 -m rltrain algo=grpo device=cuda model.dtype=$dtype trainer.total_frames=12800 \
           hydra.run.dir="/tmp/grpo_$dtype" 2>&1 | grep -E "done:|rltrain: |NonFinite" | tee -a "$out/device_llm_runs.log"
       done ;;
  *) echo "unknown part $part (tests, bench, llm or wheels)" >&2; exit 2 ;;
esac
