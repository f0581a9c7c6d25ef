#!/usr/bin/env bash
# Proves on a CPU machine that benchmarks/device_check.sh runs in one shot on the H200 device image: CI's `device`
# phase (.ci/run device).
#
#   bash benchmarks/image_sim.sh         # IMAGE_PYTHON=<a Python 3.12> to choose the interpreter
#
# 1. A fresh virtualenv on Python 3.12 (the image's python3 is 3.12.3) holding only the image's packages at its
#    versions (benchmarks/device_image_requirements.txt; jaxlib's CPU build for the CUDA plugin, no torch):
#    checked against the image's package list (benchmarks/device_image_packages.txt); grpax NOT installed.
# 2. The wheels the image lacks, into .whl/ (benchmarks/make_device_wheels.sh), as a developer makes them.
# 3. benchmarks/device_check.sh with that virtualenv's python3 first on PATH, no network (a network namespace
#    of its own when `unshare -n` works, else proxies to nowhere; pip's index off either way) and
#    DEVICE_CHECK_TINY=1; then the figures it wrote under $OUT are checked: every part measured, none failed.
# Exits non-zero if any step fails. The folder is kept when it does (its path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

find_python312() {
  local c
  for c in "${IMAGE_PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3 \
    /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [[ -n "$c" ]] || continue
    if "$c" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$c"
      return
    fi
  done
  return 1
}
py=$(find_python312) || {
  echo "image_sim: no Python 3.12 found (jax 0.11.2 and numpy 2.5.2, the image's, need it): set IMAGE_PYTHON" >&2
  exit 1
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/grpax-image.XXXXXX")
echo "--- $tmp: a virtualenv of $("$py" --version) with the image's packages only"
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --only-binary=:all: -r benchmarks/device_image_requirements.txt
"$tmp/venv/bin/python" -I - benchmarks/device_image_packages.txt <<'EOF'  # -I: not the repository (its grpax.egg-info)
import re
import sys
from importlib import metadata

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
with open(sys.argv[1]) as f:
    image = {norm(line.strip()) for line in f if line.strip() and not line.startswith("#")}
installed = sorted({norm(d.metadata["Name"]) for d in metadata.distributions()})
extra = [name for name in installed if name not in image]
if extra:
    sys.exit(f"the virtualenv holds packages the image does not: {', '.join(extra)}")
versions = {n: metadata.version(n) for n in ("jax", "jaxlib", "numpy", "flax", "optax", "orbax-checkpoint",
                                              "transformers", "pytest")}
print(f"{len(installed)} packages, all in the image's list: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
EOF
if (cd "$tmp" && "$tmp/venv/bin/python" -c "import grpax" 2>/dev/null); then
  echo "image_sim: grpax imports in the virtualenv without the repository on the path: it must not be installed" >&2
  exit 1
fi

echo "--- the wheels the image lacks: bash benchmarks/make_device_wheels.sh"
bash benchmarks/make_device_wheels.sh

offline=(env)
if unshare -n true 2>/dev/null; then
  offline=(unshare -n env)
  echo "--- no network: a network namespace of its own (unshare -n)"
else
  echo "--- no network: proxies to nowhere (unshare -n is not allowed here)"
fi
echo "--- DEVICE_CHECK_TINY=1 bash benchmarks/device_check.sh, offline, python3 = $tmp/venv/bin/python3"
"${offline[@]}" -u PYTHONPATH -u VIRTUAL_ENV PATH="$tmp/venv/bin:$PATH" PYTHONNOUSERSITE=1 \
  PIP_NO_INDEX=1 PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= PIP_CONFIG_FILE=/dev/null \
  HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 \
  https_proxy=http://127.0.0.1:9 NO_PROXY= no_proxy= \
  DEVICE_CHECK_TINY=1 OUT="$tmp/out" \
  DEVICE_CHECK_TESTS="${IMAGE_SIM_TESTS-tests/test_model_parity.py tests/test_engine.py::test_greedy_cached_decode_equals_full_forward}" \
  bash benchmarks/device_check.sh

echo "--- the figures under \$OUT"
"$tmp/venv/bin/python" - "$tmp/out" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
result = json.loads((out / "device_check.json").read_text())
rows = result["rows"]
parts = [row["part"].split()[0] for row in rows]
bad = [row for row in rows if "FAILED" in row.get("note", "") or "skipped" in row.get("note", "")]
want = ["setup", "update", "profile", "top-k", "decode", "profile", "grpo", "memory", "decode"]
for name in ("device_check.txt", "trace_update.tar.gz", "trace_decode.tar.gz", "fit_report.txt", "profiles.txt"):
    assert (out / name).stat().st_size > 0, f"no {name} under {out}"
assert parts[: len(want)] == want and not bad and result["failed"] == 0 and result["finished"], (parts, bad)
profiles = (out / "profiles.txt").read_text()
assert "per step (" in profiles and "by scope:" in profiles and "by pass:" in profiles, profiles
# Every variant ran (or, a GPU's, had its options compiled); on a CPU each decode variant that runs samples the
# default's tokens (the same threshold, phases that change no token): the comparison itself is sound.
assert len(rows) - len(want) >= 8, rows[len(want) :]
same = {label: f["same_rows"] for label, r in result["results"].items() for f in r.values() if "same_rows" in f}
assert same and all(v == 1.0 for v in same.values()), same
print(f"device check: {len(rows)} parts, none failed; decode variants with the default's tokens: {sorted(same)}")
print(f"files: {sorted(p.name for p in out.iterdir())}")
EOF
rm -rf "$tmp"
echo "image_sim: passed"
