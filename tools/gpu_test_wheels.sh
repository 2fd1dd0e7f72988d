#!/usr/bin/env bash
# The packages the test suite imports that the GPU machine's image lacks (its image has torch, triton,
# transformers, numpy, httpx, anyio, prometheus-client, ...; not loopline's server stack, xgrammar, the openai
# client or license-expression), as cp312 manylinux wheels in .whl/ (git-ignored, ~11 MB), at the versions
# `pip install -e ".[dev]"` resolved on 2026-12-06. Without them the gpu-marked structured-output, server and
# trainer tests fail on imports, not on what they test. Run here, with the package index reachable:
#   bash tools/gpu_test_wheels.sh                  # -> .whl/
# Carry .whl; tools/gpu_session.sh's `gpuall` part installs them into /tmp/gpu_site first, or by hand:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_site .whl/*.whl
#   export PYTHONPATH=$PWD:/tmp/gpu_site
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.whl}
PY=${PYTHON:-python3}
PKGS=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 annotated-doc==0.0.7 opentelemetry-api==1.45.3   # loopline serve
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2                                                        # structured outputs
  openai==3.63.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5  # dev: the client
  license-expression==30.4.4 boolean.py==5.0                                                          # train: corpus licenses
)
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$OUT" "${PKGS[@]}"
ls "$OUT" | wc -l | xargs echo "wheels in $OUT:"; du -sh "$OUT"
