#!/usr/bin/env bash
# The CUDA-only checks, in one script for a lent GPU machine (a session's `device` tool; CI has no GPU):
#   bash bench/gpu_session.sh tests|spans|full   (run from the repository root)
# The machine has torch, transformers and peft but not this project's other dependencies: their cp312 wheels travel
# with the working tree in $WHEELS (hivemind, bitsandbytes, pydantic, fastapi, ...; see docs/benchmarks-gpu.md) and
# are unpacked into /tmp/site first. Results go to $OUT (the device tool brings that folder back).
#   tests: the CUDA tests (tests/server/test_graphs.py, tests/e2e/test_gpu_swarm.py, test_decode.py's host copy: everything
#          that skips without a device)
#   spans: bench_gpu.py's in-process step times per quant type (and int8's capture error)
#   full:  bench_gpu.py's swarm and local transformers runs
#   overhead: bench_overhead.py --model gpu (issue 46): 16 and 64 gateway streams over one nf4 server with graphs vs
#          local nf4 batches; the tokenizer's files travel in $TOKENIZER (default .gputok: tokenizer.json,
#          tokenizer_config.json, chat_template.jinja of the bundled model)
#   tp:    tensor parallelism on one GPU (two shards on cuda:0): tests/swarm/modeling/test_tensor_parallel.py's CUDA case and
#          bench/bench_tensor_parallel.py on an 8B-shaped bfloat16 block (about a minute together)
set -u -o pipefail
WHEELS=${WHEELS:-.gpuwhl}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
  2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SWARMGATE_CACHE=/tmp/swarmgate-cache PATH=$PATH:/tmp/site/bin
python3 -c "import torch, transformers, bitsandbytes, hivemind; print(torch.__version__, torch.cuda.get_device_name(),
'transformers', transformers.__version__, 'bitsandbytes', bitsandbytes.__version__, 'hivemind', hivemind.__version__)"
status=0
for part in "$@"; do
  case "$part" in
    tests) timeout ${TESTS_S:-420} python3 -m pytest -q -p no:cacheprovider --timeout 300 -k "not cpu" \
             tests/server/test_graphs.py tests/e2e/test_gpu_swarm.py \
             tests/server/test_decode.py::test_host_outputs_brings_a_batch_from_the_gpu_in_one_copy_with_each_rows_part \
             2>&1 | tee "$OUT/tests.log" | tail -40 || status=1 ;;
    spans) timeout ${SPANS_S:-300} python3 bench/bench_gpu.py --parts spans ${SPANS_ARGS:-} > "$OUT/spans.json" 2> "$OUT/spans.err" || status=1
           tail -5 "$OUT/spans.err"; cat "$OUT/spans.json" ;;
    full) timeout ${FULL_S:-540} python3 bench/bench_gpu.py ${FULL_ARGS:---parts local,swarm} > "$OUT/full.json" 2> "$OUT/full.err" \
            || status=1
          tail -20 "$OUT/full.err" | cut -c1-400; cat "$OUT/full.json" ;;
    overhead) timeout ${OVERHEAD_S:-300} python3 bench/bench_overhead.py --model gpu --tokenizer "${TOKENIZER:-.gputok}" \
                ${OVERHEAD_ARGS:---streams 16,64 --new_tokens 64} > "$OUT/overhead.json" 2> "$OUT/overhead.err" || status=1
              grep -v "it/s\]" "$OUT/overhead.err" | tail -12 | cut -c1-600; cat "$OUT/overhead.json" ;;
    tp) timeout ${TP_S:-240} python3 -m pytest -q -p no:cacheprovider tests/swarm/modeling/test_tensor_parallel.py -k cuda 2>&1 \
          | tee "$OUT/tp_tests.log" | tail -15 || status=1
        timeout ${TP_S:-240} python3 bench/bench_tensor_parallel.py --devices cuda:0 cuda:0 > "$OUT/tp.json" \
          2> "$OUT/tp.err" || status=1
        tail -5 "$OUT/tp.err"; cat "$OUT/tp.json" ;;
    *) echo "unknown part $part"; status=2 ;;
  esac
done
exit $status
