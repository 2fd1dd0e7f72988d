#!/usr/bin/env bash
# Packs FlashInfer 0.7.4 for the offline GPU machine (attention_backend="flashinfer", docs/design.md "Attention
# backends"). Run here, with the package index reachable:
#   bash tools/flashinfer_payload.sh            # -> .fi/ (git-ignored): parts + SHA256SUMS + MANIFEST
# It downloads cp312 manylinux x86_64 wheels (no dependency resolution, no torch): flashinfer-python==0.7.4 and the
# runtime modules `import flashinfer` + its paged prefill wrapper import that a torch 2.11 (CUDA 13) environment
# may lack (pynvml, einops, requests and its deps, tqdm, packaging, click, tabulate, cuda.bindings). Not packed:
# torch (there), apache-tvm-ffi (.whl/ has the cp312 wheel), ninja and nvcc (the GPU machine's cuda-toolkit and
# ninja), and the extras this backend never imports (cuda-tile, nccl4py, nvidia-cutlass-dsl, cudnn-frontend:
# installed --no-deps, so they are not needed). The wheels go into one tar split into parts of at most PART_MB
# (26) MB: one part per call travels beside the repository (the carry limit is ~35 MB); tools/flashinfer_install.sh
# stashes parts on the GPU machine, joins and verifies them, and installs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.fi}
PART_MB=${PART_MB:-26}
PY=${PYTHON:-python3}
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
PKGS=(flashinfer-python==0.7.4 nvidia-ml-py einops requests urllib3 idna certifi charset-normalizer tqdm packaging
      click tabulate "cuda-bindings>=13,<14" cuda-pathfinder)
"$PY" -m pip download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WHEELS" "${PKGS[@]}"
rm -rf "$OUT"
mkdir -p "$OUT"
(cd "$WHEELS" && sha256sum -- *.whl) > "$OUT/WHEELS.sha256"
tar -C "$WHEELS" -cf "$OUT/payload.tar" .
(cd "$OUT" && split -b "$((PART_MB * 1000 * 1000))" -d -a 2 payload.tar payload.tar.part && sha256sum payload.tar > payload.sha256 \
  && rm payload.tar && ls payload.tar.part* > MANIFEST)
ls -l "$OUT"
echo "parts: $(wc -l < "$OUT/MANIFEST"); carry one per call (with MANIFEST, payload.sha256, WHEELS.sha256):"
echo "  bash tools/flashinfer_install.sh stash   # each call: copies the carried part(s) to \$STASH (/tmp/fi_parts)"
echo "  bash tools/flashinfer_install.sh install # once all parts are stashed: join, verify, pip install --target /tmp/site"
