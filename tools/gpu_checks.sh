#!/bin/bash
# The GPU checks still open in issue 18, in priority order, for one device call on a CUDA machine.
#
#   bash tools/gpu_checks.sh [SECONDS] [FIRST]   (default 540 s: one call's time, leaving some for
#                                                the start; FIRST: begin at that numbered step, so a
#                                                second call goes on where the first one stopped)
#
# 15 minutes of device time do not fit every step: the suite alone takes about 6 minutes. The order: what
# the tables still lack (the suite on this commit, the d_model 4096 share, float32 at d_model 4096),
# then the diagnostics for making the layer faster (profiles, A/B, kernel probe), then refreshes.
#
# Writes to $OUT (or ./gpu-checks when OUT is unset): log.txt, suite-nccl.log, suite.log,
# bench-bf16-d4096-e64-k2.md, prof-d1024.txt (with each variant's GPU idle time by the host work it
# waited for; the traces in traces-d1024/), bench-compiled-bf16-d1024.md (reduce-overhead),
# bench-bf16-d1024.md, bench-fp32-d4096.md, bench-assignment.md, prof-d1024-ab.txt (without the Triton
# gathers, and with .ab-base/ from make ab-base, carried, that commit), probe.txt, prof-d4096.txt;
# lm.tgz replaces the probe's file when data-cache/ is there. One call's budget reaches about the
# first three steps; a second call goes on with FIRST. Each step gets the time left before the
# deadline (a step that would start with under 30 s left is skipped and said so), so the most
# important results come back even when the budget is short.
# Needs routelab's src on the machine's python3 (make test-gpu installs it --no-deps). The lm-routers
# step needs the parallel text's cache: run `make gpu-data` on a machine with the data, and carry
# data-cache/ along (the device tool's `carry`); without it the step is skipped.
set -u
budget=${1:-540}
first=${2:-1}
n=0
out=${OUT:-gpu-checks}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s); L="$out/log.txt"
left() { echo $(( budget - ($(date +%s) - t0) )); }
step() {  # step NAME MAX_SECONDS COMMAND...: run COMMAND under min(MAX, time left)
  local name="$(( ++n )). $1" max=$2; shift 2
  if (( n < first )); then echo "$name: skipped (starting at step $first)" | tee -a "$L"; return; fi
  local t; t=$(left); (( t > max )) && t=$max
  if (( t < 30 )); then echo "[$(( $(date +%s) - t0 )) s] $name: skipped (${t} s left)" | tee -a "$L"; return; fi
  echo "[$(( $(date +%s) - t0 )) s] $name (up to $t s)" | tee -a "$L"
  timeout "$t" "$@"; echo "  rc $?" | tee -a "$L"
}
nvidia-smi --query-gpu=name,memory.used --format=csv | tee -a "$L"
# -vv names each test as it ends (make test-gpu passes -q, which one -v would cancel): a run cut by
# its deadline still says which tests failed;
# pytest-timeout (in the GPU image) ends a hung test instead of the whole step.
targs="-vv --durations=40 --tb=short"; python3 -c "import pytest_timeout" 2>/dev/null && targs="$targs --timeout=120"
# The NCCL tests first (the whole suite ran past its deadline on 2026-11-28 with exactly these left:
# xdist had scheduled them last), then the rest of the suite.
step "the NCCL tests (ExpertParallelMoE at world size 1 over NCCL, gloo against NCCL), then the whole suite \
(make test-gpu; 2026-11-28: 4164 of 4170 tests in 330 s, 0 failed, the 6 NCCL tests not reached)" 420 \
  bash -c "make test-gpu PYTEST_ARGS='$targs tests/parallel/test_parallel_backends.py' > '$out/suite-nccl.log' 2>&1; \
make test-gpu PYTEST_ARGS='$targs --ignore=tests/parallel/test_parallel_backends.py' > '$out/suite.log' 2>&1"
for f in "$out/suite-nccl.log" "$out/suite.log"; do
  [ -f "$f" ] && grep -E "FAILED|ERROR|Timeout|passed|failed" "$f" | grep -v " PASSED" | tail -30 | tee -a "$L"
done
step "bench moe bf16 d_model 4096, E = 64, top-2: the non-expert share (14.6 % by CUDA events on 2026-11-27; \
the target is < 10 %; cut at 33 s on 2026-11-28)" 110 \
  bash -c "python3 -m routelab bench moe --device cuda --dtype bfloat16 --d-model 4096 --experts 64 --k 2 \
> '$out/bench-bf16-d4096-e64-k2.md' 2>>'$L'"
step "bench moe fp32 d_model 4096, 64k tokens (never measured: the README's fp32 table lacks it; the 2026-11-28 \
run had no time left for it)" 200 \
  bash -c "python3 -m routelab bench moe --device cuda --dtype float32 --d-model 4096 > '$out/bench-fp32-d4096.md' 2>>'$L'"
step "host time by operator at d_model 1024, 8k tokens, top-1, and a second pass in reverse order: on 2026-11-28 the \
layer with its finite check (a host sync) issued its step in 4.8 ms, the same layer unchecked in 6.2-7.5 ms, on \
the CPU the other way round (tools/gpu_layer_profile.py --brief; new: the GPU's idle time and the host \
operators it waited for)" 120 \
  bash -c "python3 tools/gpu_layer_profile.py '$out/prof-d1024.txt' --brief --traces '$out/traces-d1024' > /dev/null 2>>'$L'"
step "bench moe --compile reduce-overhead (CUDA graphs), bf16 d_model 1024, top-1 (measured 2026-11-26; the default \
mode again on 2026-11-27; cut at 46 s on 2026-11-28)" 150 \
  bash -c "python3 -m routelab bench moe --device cuda --dtype bfloat16 --d-model 1024 --k 1 \
--compile reduce-overhead > '$out/bench-compiled-bf16-d1024.md' 2>>'$L'"
step "bench moe bf16 d_model 1024, 8k tokens, E in {8, 64}, top-1/top-2 (2026-11-28: 1.30M tok/s at E = 8, top-1, \
non-expert share 73-84 %: host-bound)" 90 \
  bash -c "python3 -m routelab bench moe --device cuda --dtype bfloat16 --d-model 1024 > '$out/bench-bf16-d1024.md' 2>>'$L'"
step "bench assignment on the GPU: 64 x 4096 x 64 on the device 92.8 ms and 151 host syncs on 2026-11-28 (94.2 on \
2026-11-27, 72 on 2026-11-25); since fb16091 expected 126 syncs there (25 blocking copies of the prices gone) \
and 1 instead of 2 on the host rows; new: the syncs by the line of routelab that made them, under each table" 100 \
  bash -c "python3 -m routelab bench assignment --device cuda > '$out/bench-assignment.md' 2>>'$L'"
step "A/B at d_model 1024: without the Triton gathers, and the commit of 2026-11-26 where make ab-base wrote .ab-base/ \
(carry it; inconclusive on 2026-11-28: transformers' block, the same code in each, varied 3.9-5.5 ms between passes)" 160 \
  bash -c "python3 tools/gpu_layer_profile.py '$out/prof-d1024-ab.txt' --brief --no-triton > /dev/null 2>>'$L'; \
if [ -d .ab-base/src ]; then PYTHONPATH=\$PWD/.ab-base/src python3 tools/gpu_layer_profile.py '$out/prof-d1024-base.txt' --brief \
> /dev/null 2>>'$L' && { echo \"== base: \$(cat .ab-base/REF)\"; cat '$out/prof-d1024-base.txt'; } >> '$out/prof-d1024-ab.txt'; \
rm -f '$out/prof-d1024-base.txt'; fi"
step "kernel probe: candidate forms of the largest non-expert operations, the Triton gathers (tools/gpu_kernel_probe.py)" 60 \
  bash -c "python3 tools/gpu_kernel_probe.py > '$out/probe.txt' 2>&1"
step "profile at d_model 4096, 64k tokens, E = 64, top-2, with kernel tables (the fifth session's: \
docs/gpu-profile-h200-d4096-e64-k2-triton-gathers.txt)" 120 \
  python3 tools/gpu_layer_profile.py "$out/prof-d4096.txt" --cases 64:2 --d-model 4096 --tokens 65536 \
  --traces "$out/traces-d4096"
if [ -f data-cache/parallel_text_es_en.jsonl.gz ]; then
  mkdir -p /tmp/lm
  step "lm-routers --large, 1 seed, 100 steps" 200 bash -c "python3 -m routelab.experiments.lm_routers --large \
--device cuda --seeds 0 --steps 100 --data-dir data-cache --out /tmp/lm > /tmp/lm.txt 2>&1; \
rm -f '$out/probe.txt'; tar czf '$out/lm.tgz' -C /tmp lm lm.txt"
else
  echo "lm-routers: skipped (no data-cache/: make gpu-data, and carry it)" | tee -a "$L"
fi
echo "[$(( $(date +%s) - t0 )) s] done" | tee -a "$L"
