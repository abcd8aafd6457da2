#!/usr/bin/env bash
# Builds a registry EAGLE-3 head into specula's cache (docs/eagle3.md, "Heads"), where `--draft-model NAME`
# finds it. One command, resumable: run it again after an interruption and it continues from the checkpoint.
#
#   DEVICE=cuda scripts/train-head.sh smollm2-135m-eagle3      # a GPU build (the registry head): five stages, ~20 min
#   scripts/train-head.sh smollm2-135m-eagle3                  # this CPU, ~75 minutes: a weaker head (1.01x plain)
#   scripts/train-head.sh qwen2.5-coder-1.5b-eagle3            # needs a GPU: see below (seven stages)
#
# Extra arguments go to `specula train-eagle3` (e.g. --max-minutes 9 to stop with a usable head, then rerun to
# resume). SPECULA_BIN names a prebuilt binary (no cargo build), e.g. on a GPU machine without Rust.
# The qwen2.5-coder-1.5b head trains on the GPU: its target answers thousands of prompts and the head's MLP is
# 1536 x 4096, hours on 2 CPU cores. Build with scripts/build-train-cuda.sh (dist/specula-train-cuda), then on the
# GPU machine: SPECULA_BIN=dist/specula-train-cuda scripts/train-head.sh qwen2.5-coder-1.5b-eagle3.
#
# Data: coding requests made from the Python standard library's docstrings (scripts/eagle3_prompts.py), answered
# by the target itself (self-distillation), plus chunks of the standard library's source. Never shared/prompts,
# the evaluation set.
set -euo pipefail
cd "$(dirname "$0")/.."

# Builds stages 1..LAST of the head "$name" into heads/NAME.stage<k> (each a run of this script with STAGE=k),
# copies the last to heads/NAME and exits.
all_stages() {
  local last=$1; shift
  for k in $(seq 1 "$last"); do STAGE=$k "$0" "$name" "$@"; done
  mkdir -p "$out"
  cp "$out.stage$last"/{config.json,model.safetensors,training-report.json} "$out/"
  echo "head $name (stage $last): $out"
  exit 0
}
name=${1:?usage: scripts/train-head.sh NAME [train-eagle3 args]   (smollm2-135m-eagle3, qwen2.5-coder-1.5b-eagle3)}
shift
cache=${SPECULA_CACHE:-$HOME/.cache/specula/models}
out=$cache/heads/$name
case "$name" in
  smollm2-135m-eagle3)
    target=smollm2-135m
    if [ "${DEVICE:-cpu}" = cuda ]; then
      # On a GPU (session 52, ~20 minutes on an H100): the 1.5B head's recipe, which took it from 2.3 to 3.0 tokens
      # a cycle where 600 standard-library prompts left this head at 35% first-token acceptance: 6000 general
      # requests with the standard library's source (stage 1, from random weights), then 6000 requests of each
      # later task set (stage 2 the third set, 3 the second, 4 the fourth, 5 the fifth), each stage from the one
      # before. Held-out first-token accuracy 67.6 / 77.0 / 80.4 / 83.3 / 84.7%; the five-stage head gives
      # 1.29-1.37x plain on unseen code prompts on the CPU at k = 2-4 (prompt lookup 1.11-1.20x; the CPU recipe
      # below 1.01x). STAGE=k builds one stage into heads/NAME.stage<k>; without STAGE all five, and the last is
      # copied to heads/NAME.
      common=(--device cuda --answer-batch ${ANSWER_BATCH:-128} --answer-tokens 256 --seq-len 384 --draft-vocab 8192
              --ttt-steps ${TTT_STEPS:-4} --batch ${BATCH:-4} --cache-gb 20 --seed 0)
      [ -n "${STAGE:-}" ] || all_stages 5 "$@"
      case "$STAGE" in
        1) prompts=6000; skip=0; source=general
           train_args=("${common[@]}" --epochs ${EPOCHS:-2} --corpus-tokens 300000 --lr 5e-4) ;;
        [2-5]) sets=(- - general3 general2 general4 general5)
           prompts=6000; skip=0; source=${sets[$STAGE]}
           train_args=("${common[@]}" --epochs ${EPOCHS:-2} --corpus-tokens 0 --lr ${STAGE_LR:-2e-4}
                       --init-head "$out.stage$((STAGE - 1))") ;;
        *) echo "STAGE must be 1 to 5 for $name on a GPU" >&2; exit 2 ;;
      esac
      out=$out.stage$STAGE
    else
      prompts=600
      train_args=(--answer-tokens 256 --corpus-tokens 120000 --seq-len 384 --draft-vocab 8192 --ttt-steps 4
                  --epochs 3 --batch 4 --lr 5e-4 --seed 0)
    fi
    ;;
  qwen2.5-coder-1.5b-eagle3)
    # In stages (the device's calls are 10 minutes): stage 1 trains from random weights for one epoch on 6000
    # general programming requests (scripts/eagle3_prompts.py --source general) and the standard library's source;
    # stage k > 1 starts from stage k-1's head (--init-head) at a lower learning rate for two epochs on 6000
    # requests of the second set of general tasks (--source general2: tasks stage 1 never saw; stage k takes that
    # set's requests 6000 (k - 2) to 6000 (k - 1)). Stage k lives in heads/NAME.stage<k>; the last stage's head is
    # copied to heads/NAME. STAGES (default 7) sets how many; STAGE=k runs one stage (its data, then its
    # training); BATCH sets sequences a step (default 4), EPOCHS a stage's epochs, STAGE_LR stage k > 1's rate,
    # TTT_STEPS the unrolled steps (default 4; a head drafting k = 5 on a GPU never trained its fifth position).
    # Measured on code.jsonl (unseen), H100, k = 4 (docs/benchmarks.md, session 47): stage 1 2.48 tokens a
    # cycle, stage 2 2.64, stage 3 2.81; on the CPU (session 49) stage 3 2.75, stage 4 2.81, stage 5 2.86: the
    # gain per stage fell from ~0.16 to ~0.05, so more stages of the same tasks were not the next lever: stage 6
    # takes a third set of tasks (--source general3, requests 0-5999) and gave 3.02 tokens a cycle on the CPU
    # (session 50). A second stage on the third set's next requests only tied it, and stage 6 followed by a stage
    # on a fourth task set (--source general4, session 51) lost; what gained was deeper unrolling: stage 7 trains
    # stage 6's head again on stage 6's data (copied from heads/NAME.stage6 when it is there) for one epoch with
    # seven unrolled steps instead of four (TTT_STEPS, default 7 for this stage), so the positions 5-7 a GPU
    # drafts are trained too: held-out accuracy at steps 5 / 6 / 7 74.7 / 66.7 / 57.5% -> 81.3 / 79.5 / 76.8%, k = 5
    # on an H100 2.53-2.55x plain against stage 6's 2.47-2.50x (session 57). Stage 7 is the last of the default
    # build; STAGE=8 still takes a fifth task set (general5, untrained). (Until session 46 stage 2 was 6000 requests made from the standard
    # library's docstrings: it gained nothing on unseen requests, session 21; STAGE=docstrings still builds it.
    # Until session 20 stage 1 was docstring requests too.)
    target=qwen2.5-coder-1.5b
    stages=${STAGES:-7}
    ttt=${TTT_STEPS:-4}
    [ "${STAGE:-}" = 7 ] && ttt=${TTT_STEPS:-7}
    common=(--device cuda --answer-batch ${ANSWER_BATCH:-128} --answer-tokens 256 --seq-len 384 --draft-vocab 8192
            --intermediate-size 4096 --ttt-steps "$ttt" --batch ${BATCH:-4} --cache-gb 40 --seed 0)
    [ -n "${STAGE:-}" ] || all_stages "$stages" "$@"
    case "$STAGE" in
      1) prompts=6000; skip=0; source=general
         train_args=("${common[@]}" --epochs ${EPOCHS:-1} --corpus-tokens 300000 --lr 5e-4) ;;
      docstrings) prompts=6000; skip=0; source=stdlib
         train_args=("${common[@]}" --epochs ${EPOCHS:-1} --corpus-tokens 0 --lr 2e-4 --init-head "$out.stage1") ;;
      [2-5]) prompts=$((6000 * (STAGE - 1))); skip=$((6000 * (STAGE - 2))); source=general2
         train_args=("${common[@]}" --epochs ${EPOCHS:-2} --corpus-tokens 0 --lr ${STAGE_LR:-2e-4}
                     --init-head "$out.stage$((STAGE - 1))") ;;
      6) prompts=6000; skip=0; source=general3
         train_args=("${common[@]}" --epochs ${EPOCHS:-2} --corpus-tokens 0 --lr ${STAGE_LR:-2e-4}
                     --init-head "$out.stage5") ;;
      7) prompts=6000; skip=0; source=general3
         # Stage 6's data again: the same requests and the target's same answers, without making them twice.
         if [ -s "$out.stage6/data.jsonl" ] && [ ! -e "$out.stage7/data.jsonl" ]; then
           mkdir -p "$out.stage7" && cp "$out.stage6/data.jsonl" "$out.stage6/prompts.jsonl" "$out.stage7/"
         fi
         train_args=("${common[@]}" --epochs ${EPOCHS:-1} --corpus-tokens 0 --lr ${STAGE_LR:-2e-4}
                     --init-head "$out.stage6") ;;
      8) prompts=6000; skip=0; source=general5
         train_args=("${common[@]}" --epochs ${EPOCHS:-2} --corpus-tokens 0 --lr ${STAGE_LR:-2e-4}
                     --init-head "$out.stage7") ;;
      *) echo "STAGE must be 1 to 8 (or docstrings)" >&2; exit 2 ;;
    esac
    out=$out.stage$STAGE
    ;;
  *)
    echo "unknown head $name (known: smollm2-135m-eagle3, qwen2.5-coder-1.5b-eagle3)" >&2
    exit 2
    ;;
esac
if [ -n "${SPECULA_BIN:-}" ]; then
  bin=$SPECULA_BIN
else
  cargo build --release -p specula-cli
  bin=target/release/specula
fi
mkdir -p "$out"
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
[ -s "$out/prompts.jsonl" ] ||
  python3 scripts/eagle3_prompts.py --source "${source:-stdlib}" --count "$prompts" --skip "${skip:-0}" \
    --out "$out/prompts.jsonl"
resume=()
[ -e "$out/data.jsonl" ] && resume=(--resume)
"$bin" train-eagle3 -m "$target" --out "$out" --prompts "$out/prompts.jsonl" --corpus "$stdlib" \
  "${train_args[@]}" "${resume[@]}" --json "$out/training-report.json" "$@"
echo "head $name: $out"
