#!/usr/bin/env bash
# The CUDA path's checks, for a machine with an NVIDIA GPU, torch built for CUDA and
# flashinfer-python 0.6.18 importable (docs/backend.md, "CUDA path"):
#
#   benchmarks/cuda_check.sh OUT [LIKE]
#
# 1. where the default model is not converted yet and LIKE (a converted model directory's
#    config + tokenizer) is given, random weights of its shapes in its place
#    (benchmarks/random_model.py: the GPU machine this was written for takes 64 MiB of files
#    and reaches no network; the default GGUF is 98 MB);
# 2. tests/test_cuda.py: FlashInfer against the torch reference, fp32 greedy on CUDA against
#    HF transformers, CUDA graphs against eager decode;
# 3. benchmarks/backend.py on CUDA: FlashInfer + CUDA graphs, FlashInfer eager, torch
#    attention, each against HF transformers on the same GPU.
# Logs and result files go to OUT. Every step runs under a time limit and the others still
# run when one fails; the exit status is the number of steps that failed.
set -u
out=${1:?usage: benchmarks/cuda_check.sh OUT [LIKE]}
like=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME SECONDS COMMAND...: run, log to OUT/NAME.log, count a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T))"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: exit $rc"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi -L
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), '| flashinfer', flashinfer.__version__)"
model=$(python3 -c "from pie.config import PieConfig; from pie.backend.weights import default_model_dir; print(default_model_dir(PieConfig().paths.cache))")
if [ ! -f "$model/config.json" ] && [ -n "$like" ]; then
    step random_model 300 python3 benchmarks/random_model.py --like "$like" --out "$model"
fi
step test_cuda 420 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py
step bench_graphs 300 python3 benchmarks/backend.py --device cuda --attention flashinfer --cuda-graphs --out "$out/backend-cuda.json"
step bench_flashinfer 300 python3 benchmarks/backend.py --device cuda --attention flashinfer --out "$out/backend-cuda-eager.json"
step bench_torch 300 python3 benchmarks/backend.py --device cuda --attention torch --out "$out/backend-cuda-torch.json"
exit $failed
