#!/usr/bin/env bash
# One step of a lent GPU machine's session (docs/development.md, "A lent GPU machine, in order"),
# run from the checkout's root on that machine, after the wheel calls have left DALI's parts in
# /tmp/wh (../shared/gpu/README.md):
#
#   bash bench/lent_gpu.sh tests 5 6          # the gpu-marked tests, slices 5/6 and 6/6 at once
#   bash bench/lent_gpu.sh rows "gpupipe train,gpupipe train v2"   # bench/gpu.py, those rows
#   bash bench/lent_gpu.sh bench              # the whole of bench/gpu.py, as far as time allows
#   bash bench/lent_gpu.sh probes             # bench/operator_cost.py and bench/policy_stage.py
#   bash bench/lent_gpu.sh scale              # bench/scale_out.py --scaling-only (needs Ray's wheels)
#
# Each step installs the wheels once per machine (/tmp/site), runs under `timeout` (LENT_TIMEOUT
# seconds, default 270, so that the call's own limit is never what stops it) with python3 (PY
# names another), packs what it wrote into one file, $OUT/<step>.tgz (a call brings back at most
# 8 files), and prints the logs' ends. Give the device call a timeout_s of LENT_TIMEOUT + 60.
set -uo pipefail
step=${1:-}
shift || true
limit=${LENT_TIMEOUT:-270}
py=${PY:-python3}  # the interpreter (the lent machines: their python3)
out=${OUT:?"OUT: the folder whose files come back (the device tool sets it)"}
usage="usage: bash bench/lent_gpu.sh tests K [K ...] | rows RECIPES | bench | probes | scale"
case "$step" in tests | rows | bench | probes | scale) ;; *) echo "$usage" >&2; exit 2 ;; esac
if [ "$step" = tests ] && [ $# -eq 0 ]; then echo "$usage" >&2; exit 2; fi
if [ "$step" = rows ] && [ $# -ne 1 ]; then echo "$usage" >&2; exit 2; fi

if [ -d /tmp/wh ] && [ ! -d /tmp/site ]; then
  mkdir -p /tmp/wx && cat /tmp/wh/part.* | tar -xf - -C /tmp/wx &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wx/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
work=$(mktemp -d)
started=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; nproc
  git log -1 --format='tree %h' 2>/dev/null; } > "$work/env.txt"

# nvImageCodec's complaints about the optional JPEG 2000 and TIFF libraries, on every process
quiet() { grep -v 'nvjpeg2k\|nvtiff\|nvJPEG2000\|nvTIFF' "$@"; }
timed() {  # NAME COMMAND...: the command under the time limit, its log in $work/NAME.log
  local name=$1
  shift
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "$name: rc=$? after $(($(date +%s) - started)) s" >> "$work/env.txt"
}

case "$step" in
  tests)
    for k in "$@"; do
      GPUPIPE_TEST_LOG=$work/failures$k.txt timed "slice$k" \
        "$py" -m pytest -q -m gpu -rfEs -p no:cacheprovider --part "$k/6" &
    done
    wait
    ;;
  rows) timed rows "$py" bench/gpu.py --sets imagenet-like --threads 8 --recipes "$1" --out "$work" ;;
  bench) timed bench "$py" bench/gpu.py --budget $((limit * 2 / 3)) --out "$work" ;;  # its last row may run on
  probes)
    timed operator_cost "$py" bench/operator_cost.py --device gpu --out "$work"
    timed policy_stage "$py" bench/policy_stage.py --device gpu --out "$work"
    ;;
  scale) timed scale "$py" bench/scale_out.py --scaling-only --out "$work" ;;
esac
tar -czf "$out/$step.tgz" -C "$work" .
cat "$work/env.txt"
for log in "$work"/*.log; do echo "== $(basename "$log")"; quiet "$log" | tail -n 25; done
