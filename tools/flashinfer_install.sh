#!/usr/bin/env bash
# The GPU machine's side of tools/flashinfer_payload.sh: verify the carried .fi/site.tar.xz, copy into SITE the
# unpacked wheels whose module the environment lacks, and set up what FlashInfer's JIT needs.
#   bash tools/flashinfer_install.sh install   # sha256-check, unpack, copy flashinfer + tvm-ffi + what is missing
#   source <(bash tools/flashinfer_install.sh env)   # exports for the run (PYTHONPATH, CUDA_HOME, PATH, FLASHINFER_*)
#   bash tools/flashinfer_install.sh check     # imports flashinfer, JIT-compiles and runs one paged attention
# FlashInfer's JIT (flashinfer/jit/cpp_ext.py) runs `$CUDA_HOME/bin/nvcc` through ninja and links with
# -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda. The cuda-toolkit pip package keeps nvcc, headers
# and libraries under site-packages/nvidia/cu13/{bin,include,lib} (no lib64, no unversioned libcudart.so), so
# `env` builds a CUDA_HOME of symlinks (CUDA_SHIM): every entry of that directory, plus lib64/ holding lib/'s
# files, libcudart.so -> libcudart.so.13 and libcuda.so -> the driver's libcuda.so.1. Kernels compile for sm_90
# only (FLASHINFER_CUDA_ARCH_LIST=9.0a, the H200) into FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (/tmp: kept
# while the machine stays warm; the first paged-prefill compile takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
SHIM=${CUDA_SHIM:-/tmp/cuda_home}
PY=${PYTHON:-python3}
CARRIED=${CARRIED:-.fi}

have() { PYTHONPATH= "$PY" -c "import $1" > /dev/null 2>&1; }

install() {
  (cd "$CARRIED" && sha256sum -c site.sha256)
  local work; work=$(mktemp -d)
  xz -dc "$CARRIED/site.tar.xz" | tar -C "$work" -xf -
  # module -> distribution folder: copied only where the environment lacks the module, so nothing it has
  # (torch's own cuda-bindings, say) is shadowed by another version on PYTHONPATH
  local dists=(flashinfer_python) pairs=(pynvml:nvidia_ml_py einops:einops requests:requests urllib3:urllib3
               idna:idna certifi:certifi charset_normalizer:charset_normalizer tqdm:tqdm packaging:packaging
               click:click tabulate:tabulate cuda.bindings:cuda_bindings cuda.pathfinder:cuda_pathfinder
               tvm_ffi:apache_tvm_ffi)
  for pair in "${pairs[@]}"; do
    if ! have "${pair%%:*}"; then dists+=("${pair##*:}"); fi
  done
  echo "installing into $SITE: ${dists[*]}"
  mkdir -p "$SITE"
  for d in "${dists[@]}"; do cp -a "$work/$d/." "$SITE/"; done
  rm -rf "$work"
}

make_shim() {  # a CUDA_HOME of symlinks over the pip layout $1 (see the header)
  local cu=$1
  rm -rf "$SHIM" && mkdir -p "$SHIM/lib64/stubs"
  for e in "$cu"/*; do [ "$(basename "$e")" = lib64 ] || ln -s "$e" "$SHIM/$(basename "$e")"; done
  for l in "$cu"/lib/* "$cu"/lib64/*; do if [ -e "$l" ]; then ln -sf "$l" "$SHIM/lib64/$(basename "$l")"; fi; done
  local rt drv
  rt=$(find "$cu"/lib "$cu"/lib64 -maxdepth 1 -name 'libcudart.so.*' 2>/dev/null | head -1 || true)
  if [ -n "$rt" ]; then ln -sf "$rt" "$SHIM/lib64/libcudart.so"; fi
  drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}' || true)
  if [ -n "$drv" ]; then ln -sf "$drv" "$SHIM/lib64/stubs/libcuda.so"; fi
}

env_() {
  local cu
  cu=$(PYTHONPATH= "$PY" - <<'PYEOF'
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
hits = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "cu*", "bin", "nvcc"))]
hits += [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "cuda_nvcc", "bin", "nvcc"))]
print(os.path.dirname(os.path.dirname(hits[0])) if hits else "")
PYEOF
)
  # an explicit CUDA_HOME first, then the pip toolkit (above), a system toolkit, and nvcc on PATH
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then cu=$CUDA_HOME; fi
  if [ -z "$cu" ]; then
    for c in /usr/local/cuda /usr/local/cuda-*; do if [ -x "$c/bin/nvcc" ]; then cu=$c; break; fi; done
  fi
  if [ -z "$cu" ] && command -v nvcc > /dev/null; then cu=$(dirname "$(dirname "$(command -v nvcc)")"); fi
  [ -n "$cu" ] || { echo "echo 'no nvcc found (cuda-toolkit pip package with nvcc, or nvcc on PATH)' >&2; false"; return; }
  if [ -e "$cu/lib64/libcudart.so" ]; then SHIM=$cu; else make_shim "$cu"; fi
  echo "export CUDA_HOME=$SHIM"
  echo "export PATH=$SHIM/bin:\$PATH"
  echo "export PYTHONPATH=$PWD:$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"
  echo "export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp}"
  echo "export MAX_JOBS=${MAX_JOBS:-16}"
}

check() {
  # shellcheck disable=SC1090
  source <(env_)
  "$PY" - <<'PYEOF'
import time, torch, flashinfer
from loopline.attention import get_attention_backend
from loopline.attention.base import PagedAttentionMetadata
print("flashinfer", flashinfer.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
dev = torch.device("cuda")
tri, fi = get_attention_backend("triton", dev), get_attention_backend("flashinfer", dev)
k = torch.randn(64, 16, 16, 128, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
tables = torch.randperm(64, device=dev, dtype=torch.int32)[:32].view(4, 8)
for q_lens in ([1, 1, 1, 1], [1, 40, 1, 7]):
    lens = torch.tensor([128, 100, 37, 77], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
    meta = PagedAttentionMetadata(qsl, lens, tables, torch.zeros(sum(q_lens), dtype=torch.int64, device=dev),
                                  max(q_lens), 128)
    q = torch.randn(sum(q_lens), 16, 128, device=dev, dtype=torch.bfloat16)
    t = time.time(); got = fi.attend(q, k, v, meta, 128 ** -0.5); torch.cuda.synchronize()
    diff = (got.float() - tri.attend(q, k, v, meta, 128 ** -0.5).float()).abs().max().item()
    print(f"q_lens {q_lens}: first call {time.time() - t:.1f} s (JIT), max diff vs triton {diff:.2e}")
    assert diff < 2e-2
PYEOF
}

case "${1:-}" in
  install) install ;;
  env) env_ ;;
  check) check ;;
  *) echo "usage: $0 install|env|check" >&2; exit 2 ;;
esac
