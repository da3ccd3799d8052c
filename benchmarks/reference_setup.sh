#!/usr/bin/env bash
# Fetch what benchmarks/reference_dlrmv3.py needs to time Meta's reference DLRMv3 training loop:
# a clone of generative-recommenders at the commit the harness was checked against, unedited, and the
# reference's extra pure-Python packages in a folder of their own (nothing is installed into the env).
#
# Use: [PYTHON=.venv/bin/python] bash benchmarks/reference_setup.sh [DIR]     (DIR default ./.reference)
#   DIR/generative-recommenders  the clone, checked out at $GR_COMMIT (detached)
#   DIR/deps                     gin-config pandas python-dateutil six pytz tzdata (--no-deps)
# PYTHON is the interpreter that will run the harness (default: python); it needs torch, torchrec and
# fbgemm-gpu already. Its pip installs the packages; without pip (a uv-made venv) uv's pip does.
# GR_REPO_URL overrides where to clone from (e.g. a local mirror). Running it again reuses the clone.
set -euo pipefail

DIR="${1:-./.reference}"
PYTHON="${PYTHON:-python}"
GR_REPO_URL="${GR_REPO_URL:-https://github.com/meta-recsys/generative-recommenders}"
GR_COMMIT="db1bf8f"
DEPS=(gin-config pandas python-dateutil six pytz tzdata)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "reference_setup.sh: error: $*" >&2; exit 1; }

command -v git >/dev/null || die "git is not installed; install git and run this again"
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON is not an executable; set PYTHON to the interpreter that has torch and torchrec (e.g. PYTHON=.venv/bin/python)"

mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
GR="$DIR/generative-recommenders"

if [[ -d "$GR/.git" ]]; then
  echo "== reusing the clone in $GR"
  git -C "$GR" cat-file -e "$GR_COMMIT^{commit}" 2>/dev/null || git -C "$GR" fetch --quiet origin \
    || die "could not fetch $GR_COMMIT into $GR; check the network or delete $GR and run this again"
elif [[ -e "$GR" ]]; then
  die "$GR exists but is not a git clone; move it away or pick another DIR"
else
  echo "== cloning $GR_REPO_URL into $GR"
  git clone --quiet "$GR_REPO_URL" "$GR" \
    || die "git clone $GR_REPO_URL failed; check the network (or set GR_REPO_URL to a reachable mirror)"
fi
git -C "$GR" -c advice.detachedHead=false checkout --quiet "$GR_COMMIT" \
  || die "could not check out $GR_COMMIT in $GR; is $GR_REPO_URL the generative-recommenders repository?"
echo "   at $(git -C "$GR" log -1 --format='%h %s')"

echo "== installing ${DEPS[*]} into $DIR/deps (for $PYTHON)"
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet --target "$DIR/deps" --no-deps --upgrade "${DEPS[@]}"
elif command -v uv >/dev/null; then
  uv pip install --quiet --python "$PYTHON" --target "$DIR/deps" --no-deps "${DEPS[@]}"
else
  die "$PYTHON has no pip and uv is not on PATH; install pip ($PYTHON -m ensurepip) or uv, or run: python -m pip install --target $DIR/deps --no-deps ${DEPS[*]}"
fi

RUN="$PYTHON $HERE/reference_dlrmv3.py --gr_dir $GR --deps_dir $DIR/deps"
echo "== ready. Time the reference loop (RecIR --uih_len 64 == --max_seq_len 76; add --help for options):"
echo "   $RUN --max_seq_len 76 --steps 10"
