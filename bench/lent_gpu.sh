#!/usr/bin/env bash
# One step of a lent GPU machine's session (docs/development.md, "A lent GPU machine, in order"),
# run from the checkout's root on that machine, after the wheel calls have left DALI's parts in
# /tmp/wh (../shared/gpu/README.md):
#
#   bash bench/lent_gpu.sh tests 5 6          # the gpu-marked tests, slices 5/6 and 6/6 at once
#   bash bench/lent_gpu.sh rows "gpupipe train;gpupipe train v2"   # bench/gpu.py, those rows
#   bash bench/lent_gpu.sh bench              # the whole of bench/gpu.py, as far as time allows
#   bash bench/lent_gpu.sh probes             # bench/operator_cost.py, policy_stage.py, stage_profile.py
#   bash bench/lent_gpu.sh scale              # bench/scale_out.py --scaling-only (needs Ray's wheels)
#   bash bench/lent_gpu.sh jitter             # bench/color_jitter.py on 1,024 images
#   bash bench/lent_gpu.sh loader             # gpupipe bench --profile (train, V2) and data_stall.py's meter
#
# Each step installs the wheels once per machine (/tmp/site) and runs its commands with python3
# (PY names another) before one deadline, LENT_TIMEOUT seconds (default 270) after the step
# starts: each command gets the time left, under `timeout -k 15`. Then it packs what it wrote into
# one file, $OUT/<step>.tgz (a call brings back at most 8 files), and prints the logs' ends. Give
# the device call a timeout_s of LENT_TIMEOUT + 60.
#
# Exit status: 0 when every command exited 0; else 1 (each command's status is in env.txt and
# printed); 2 for a bad command line or $OUT.
set -uo pipefail
usage="usage: bash bench/lent_gpu.sh tests K [K ...] | rows 'ROW;ROW;...' | bench | probes | scale | jitter | loader"
step=${1:-}
[ $# -gt 0 ] && shift
case "$step" in
  tests) [ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
         for k in "$@"; do case "$k" in [1-6]) ;; *) echo "tests: slices are 1 to 6, got '$k'" >&2; exit 2 ;; esac; done ;;
  rows) [ $# -eq 1 ] || { echo "$usage" >&2; exit 2; } ;;
  bench | probes | scale | jitter | loader) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
out=${OUT:-}
[ -n "$out" ] && [ -d "$out" ] || { echo "OUT must name an existing folder: the one whose files come back" >&2; exit 2; }
limit=${LENT_TIMEOUT:-270}
py=${PY:-python3}
started=$(date +%s)
deadline=$((started + limit))
work=$(mktemp -d)
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; nproc; "$py" --version
  git log -1 --format='commit %h' 2>/dev/null; } > "$work/env.txt" 2>&1

if [ -d /tmp/site ]; then
  :
elif [ -d /tmp/wh ]; then
  mkdir -p /tmp/wx && cat /tmp/wh/part.* | tar -xf - -C /tmp/wx &&
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wx/*.whl ||
    { echo "the wheels in /tmp/wh did not install" >&2; exit 1; }
else
  echo "no wheels in /tmp/wh: $py's own packages" >> "$work/env.txt"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

status=0
timed() {  # NAME COMMAND...: the command in the time left, its log in $work/NAME.log, its status in env.txt
  local name=$1 begun rc left
  shift
  begun=$(date +%s)
  left=$((deadline - begun))
  if [ "$left" -le 0 ]; then
    echo "$name: not run, no time left" >> "$work/env.txt"
    return 1
  fi
  timeout -k 15 "$left" "$@" > "$work/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $(($(date +%s) - begun)) s" >> "$work/env.txt"
  return "$rc"
}

case "$step" in
  tests)
    pids=()
    for k in "$@"; do
      if [ "$k" = 1 ]; then  # as `make test-gpu PART=1/N` does
        timed doctor "$py" -m gpupipe doctor --run || status=1
      fi
      GPUPIPE_TEST_LOG=$work/failures$k.txt timed "slice$k" \
        "$py" -m pytest -q -m gpu -rfEs -p no:cacheprovider --part "$k/6" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    ;;
  rows) timed rows "$py" bench/gpu.py --sets imagenet-like --threads 8 --recipes "$1" --out "$work" || status=1 ;;
  bench) timed bench "$py" bench/gpu.py --budget $((limit * 2 / 3)) --out "$work" || status=1 ;;  # its last row runs on
  probes)
    timed operator_cost "$py" bench/operator_cost.py --device gpu --out "$work" || status=1
    timed policy_stage "$py" bench/policy_stage.py --device gpu --out "$work" || status=1
    timed stage_profile "$py" bench/stage_profile.py --device gpu --out "$work" || status=1
    ;;
  scale) timed scale "$py" bench/scale_out.py --scaling-only --out "$work" || status=1 ;;
  jitter) timed jitter "$py" bench/color_jitter.py --images 1024 --data /tmp/gpupipe-jitter --out "$work" || status=1 ;;
  loader)  # issue 54 on a GPU: the stage times and verdict per batch, and the meter against data_stall.py's clock
    timed stall "$py" bench/data_stall.py --data /tmp/gpupipe-stall --steps 100 --out "$work" || status=1
    shards='/tmp/gpupipe-stall/train-{000000..000003}.tar'
    timed profile_train "$py" -m gpupipe bench pipelines/imagenet.py:train "$shards" --device cuda --batch-size 256 \
      --epochs 3 --quiet --profile "$work/profile-train.png" --json "$work/profile-train.json" || status=1
    timed profile_v2 "$py" -m gpupipe bench pipelines/imagenet.py:train_v2 "$shards" --device cuda --batch-size 256 \
      --epochs 3 --quiet --profile "$work/profile-v2.png" --json "$work/profile-v2.json" || status=1
    ;;
esac
tar -czf "$out/$step.tgz" -C "$work" . || { echo "could not write $out/$step.tgz" >&2; exit 1; }
cat "$work/env.txt"
# nvImageCodec's complaints about the optional JPEG 2000 and TIFF libraries, in every process
for log in "$work"/*.log; do
  [ -e "$log" ] || continue
  echo "== $(basename "$log")"
  { grep -v 'nvjpeg2k\|nvtiff\|nvJPEG2000\|nvTIFF' "$log" || true; } | tail -n 25
done
exit "$status"
