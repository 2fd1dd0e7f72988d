#!/usr/bin/env bash
# Packs what verl 0.9.1's trainer needs on the offline GPU machine (docs/rl.md, "Wheels for the GPU run") into
# one xz tar that travels beside the repository in a call (the carry limit leaves ~35 MB once the tree counts;
# the GPU image's own packages are not carried, except tokenizers: its 0.23.2 is newer than transformers 5.10.4 takes).
# Run here, with the package index reachable:
#   bash tools/verl_payload.sh            # -> .verl/ (git-ignored): site.tar.xz + site.sha256
# Each wheel is unpacked into its own folder (what `pip install --no-deps --target` writes). Ray's wheel is 79 MB:
# its Java jar, the dashboard's source maps and web UI scripts are left out (never loaded here), and every native
# binary is stripped of symbols (--strip-unneeded), which brings the payload to 33 MB (the repository is ~29 MB
# of the 64 MiB a call carries).
# On the GPU machine: bash tools/verl_payload.sh install   # verify, unpack into SITE (/tmp/site), and write
# loopline's package metadata there (its verl plug-in's entry point: loopline runs from the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
PAYLOAD=${PAYLOAD:-.verl}  # (not OUT: the device tool sets OUT to its results folder)
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
if [ "${1:-}" = install ]; then
  (cd "$PAYLOAD" && sha256sum -c site.sha256)
  mkdir -p "$SITE"
  work=$(mktemp -d)
  xz -dc "$PAYLOAD/site.tar.xz" | tar -C "$work" -xf -
  for d in "$work"/*/; do cp -a "$d." "$SITE/"; done
  rm -rf "$work"
  # loopline itself runs from the checkout on PYTHONPATH, not installed: its entry point (`import verl` loads
  # the "verl.plugins" group, which registers rollout.name=loopline and the Ouro model classes) needs metadata
  meta="$SITE/loopline-0.1.0.dist-info"
  mkdir -p "$meta"
  printf 'Metadata-Version: 2.1\nName: loopline\nVersion: 0.1.0\n' > "$meta/METADATA"
  printf '[verl.plugins]\nloopline = loopline.integrations.verl\n' > "$meta/entry_points.txt"
  # Bytecode for every module, on all cores, before the runs: on a fresh machine verl's processes (driver, task
  # runner, workers, server) otherwise compile the same modules as they first import them
  start=$SECONDS
  "$PY" -m compileall -q -j 0 "$SITE" > /dev/null 2>&1 || true
  echo "installed into $SITE: $(ls "$SITE" | grep -c dist-info) distributions (bytecode in $((SECONDS - start)) s)"
  exit 0
fi
# the distributions of docs/rl.md's table ("Wheels for the GPU run"), at the versions that ran on the CPU
PKGS=(verl==0.9.1 transformers==5.10.4 tokenizers==0.22.2 hydra-core==1.3.8 omegaconf==2.3.1 tensordict==0.10.0 pyvers==0.1.0
  orjson==3.13.0 cloudpickle==3.1.3 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 codetiming==1.4.0
  torchdata==0.11.0 tabulate==0.10.0 TransferQueue==0.1.11 pyzmq==27.3.0 msgspec==0.23.0 cachetools==8.0.2
  prometheus_client==0.26.0 ray==2.60.0 msgpack==1.2.4 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4
  yarl==1.25.1 aiohttp-cors==0.8.1 colorful==0.5.8 colorama==0.4.6 opencensus==0.11.4 opencensus-context==0.1.3
  google-api-core==2.44.0 google-auth==2.63.0 googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-http-transport==0.66b2 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
  uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHEELS" "${PKGS[@]}"
"$PY" -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$WHEELS"  # published as an sdist only
STAGE=$WHEELS/stage
for w in "$WHEELS"/*.whl; do
  name=$(basename "$w"); name=${name%%-*}
  mkdir -p "$STAGE/$name" && unzip -q "$w" -d "$STAGE/$name"  # (unzip keeps the executables' mode bits)
done
ray=$STAGE/ray/ray
rm -rf "$ray/jars"
find "$ray/dashboard" -name '*.map' -delete
rm -rf "$ray/dashboard/client/build/static"  # the web UI's scripts and styles: no browser reaches this machine
for f in "$ray/core/src/ray/gcs/gcs_server" "$ray/core/src/ray/raylet/raylet"; do
  strip --strip-unneeded "$f"
done
find "$STAGE" -name '*.so' -exec strip --strip-unneeded {} +  # (aiohttp's parsers: 3.4 MB -> 0.6 MB each)
rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"
tar -C "$STAGE" -cf - . | xz -9 -T0 > "$PAYLOAD/site.tar.xz"
(cd "$PAYLOAD" && sha256sum site.tar.xz > site.sha256)
ls -l "$PAYLOAD"
