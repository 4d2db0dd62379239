#!/usr/bin/env bash
# Wheels the GPU machines' image lacks, for its Python (3.12), into .whl/ (git-ignored; the device tool carries
# it): the server's stack, the event, hash and grammar libraries, and transformers at the version the parity tests
# pin (the image has another). The image's own packages (torch, numpy, tokenizers, safetensors, ...) are used as
# they are: `/work/.library/device/KINDS.md` lists them.
#
#   bash scripts/device_wheels.sh      # here, with a package registry; then scripts/device_check.sh there
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION=${DEVICE_PYTHON:-3.12}
# Distribution names (as wheel files spell them) that device_check.sh needs and the image does not hold.
KEEP=(fastapi starlette pydantic pydantic_core annotated_types typing_inspection uvicorn pyzmq cbor2 llguidance
      transformers)
WANT=(fastapi uvicorn pyzmq "cbor2>=5.4" "llguidance>=1.9" "transformers==5.25.0")  # pyproject.toml's bounds

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
python -m pip download -q --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$stage" "${WANT[@]}"
rm -rf .whl
mkdir -p .whl
for name in "${KEEP[@]}"; do
    cp "$stage/$name"-[0-9]*.whl .whl/
done
du -sh .whl
ls .whl
