#!/usr/bin/env bash
# Packs FlashInfer 0.7.4 for the offline GPU machine (attention_backend="flashinfer", docs/design.md "Attention
# backends"). Run here, with the package index reachable:
#   bash tools/flashinfer_payload.sh            # -> .fi/ (git-ignored): site.tar.xz + site.sha256
# It downloads cp312 manylinux x86_64 wheels (no dependency resolution, no torch): flashinfer-python==0.7.4,
# apache-tvm-ffi, and the runtime modules `import flashinfer` + its paged prefill wrapper import that a torch 2.11
# (CUDA 13) environment may lack (pynvml, einops, requests and its deps, tqdm, packaging, click, tabulate,
# cuda.bindings). Not packed: torch (there), ninja and nvcc (the GPU machine's cuda-toolkit and ninja), and the
# extras this backend never imports (cuda-tile, nccl4py, nvidia-cutlass-dsl, cudnn-frontend).
# The wheels are zip files of mostly C++/CUDA sources (flashinfer's is 101 MB); each is unpacked into its own
# folder (what `pip install --no-deps --target` writes) and the folders go into one xz tar of ~25 MB, so the
# whole payload travels beside the repository in one call (the carry limit is ~35 MB once the tree is counted).
# tools/flashinfer_install.sh verifies it and copies in the folders whose module the environment lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.fi}
PY=${PYTHON:-python3}
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
PKGS=(flashinfer-python==0.7.4 "apache-tvm-ffi>=0.1.11,<0.2" nvidia-ml-py einops requests urllib3 idna certifi
      charset-normalizer tqdm packaging click tabulate "cuda-bindings>=13,<14" cuda-pathfinder)
"$PY" -m pip download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WHEELS" "${PKGS[@]}"
STAGE=$WHEELS/stage
for w in "$WHEELS"/*.whl; do
  name=$(basename "$w"); name=${name%%-*}         # distribution name, as in the wheel's file name
  mkdir -p "$STAGE/$name" && unzip -q "$w" -d "$STAGE/$name"  # (unzip keeps the executables' mode bits)
done
rm -rf "$OUT"
mkdir -p "$OUT"
tar -C "$STAGE" -cf - . | xz -9 -T0 > "$OUT/site.tar.xz"
(cd "$OUT" && sha256sum site.tar.xz > site.sha256)
ls -l "$OUT"
echo "on the GPU machine (carry .fi): bash tools/flashinfer_install.sh install && source <(bash tools/flashinfer_install.sh env)"
