#!/usr/bin/env bash
# One device-tool call per stage; results go to $OUT (tarred into one file, the tool returns few files).
#   a: the GPU test suite and the layer benchmark      b: the model benchmarks and the parity run
#   c: the compile/rounding GPU tests, then eager (3 rounds) vs compiled on 8 layers of the 8B model, one call
#      (the full `pytest -m gpu tests` takes more than 260 s on its own: run it in a call of its own)
#   d: where the norm's time goes (benchmarks/norm_variants.py), then the layer benchmark at r = 384
#   e: (nvidia-h200) the qwen2.5-32b model benchmark
#   f: after a norm change: its GPU tests, its pieces against the earlier kernel (carry .out/old_norm.py, from
#      `git show 87cfff6:src/flashdora/kernels/norm.py`), the layer benchmark at r = 384, the 8B model benchmark
#   h: the norm's, ops', PEFT seam's and compile GPU tests, the norm's pieces, the layer benchmark at r = 384
#   g: the norm's GPU tests and pieces, the layer benchmark at r = 384, the 8B model benchmark and accumulation 4,
#      each with 2 rounds
#   s: the norm's pieces with the epilogue/Gram sweep; kernels, host ops and Python of 4 qwen2.5-32b layers
#   v: the norm's, ops', PEFT seam's and compile GPU tests, the norm's pieces, the layer benchmark at r = 384 and the
#      8B model benchmark, one call
#   i: where llama3-8b's eager time goes (4 layers: host vs GPU, norm counts), then the 8B model benchmark, 2 rounds
#   m: the ops' GPU tests, then the layer benchmark's peak memory at the two large shapes (after a backward change)
#   n: (nvidia-h200) qwen2.5-32b grad, PEFT LoRA and flashdora
#   w: GPU tests of kernels, ops and the PEFT seam, the norm against the GEMM (7 repeats), the layer benchmark at
#      r = 384, 4 layers of llama3-8b host vs GPU (after OLD_SRC's run when set), the launch pieces' host cost
#   x: the allocator in each accumulation-4 step of llama3-8b (benchmarks/alloc_stats.py), default allocator, then
#      expandable segments: which counters (cudaMalloc/cudaFree, retries) move in flashdora's steps and not LoRA's
#   y: after host-side changes: the GPU tests of kernels, ops, PEFT seam and compile, the 8B model benchmark
#      (2 rounds), the layer benchmark at r = 384, and one layer's host cost (benchmarks/host_layer.py)
#   p SEED: the training-curve parity from a pretrained start, one seed (about 9 minutes; merge the seeds here with
#      `flashdora parity --merge FILE...`)
# Usage (device tool): FLASHDORA_COMMIT=<sha> bash benchmarks/gpu_run.sh a
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 FLASHDORA_DIRTY=${FLASHDORA_DIRTY:-0}
OUT=${OUT:-/tmp/out}
R=$OUT/results
mkdir -p "$R"
fd="python3 -m flashdora.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/device.txt"
case "${1:-a}" in
  a)
    timeout 120 python3 -m pytest -m gpu tests -q -x -p no:cacheprovider -k "dora_linear or bf16_error" 2>&1 | tail -5 \
      | tee "$R/pytest_gpu.txt"
    timeout 330 $fd bench layer --ranks 16 64 384 --tokens 2048 --dtypes autocast --out "$R"
    timeout 100 $fd bench layer --shapes 4096x4096 8192x28672 --ranks 384 --tokens 2048 8192 --dtypes bf16 \
      --tag bf16 --out "$R"
    ;;
  b)
    timeout 60 python3 -m pytest -m gpu tests -q -x -p no:cacheprovider -k "dora_linear or bf16_error" 2>&1 | tail -3 \
      | tee "$R/pytest_gpu.txt"
    timeout 150 $fd bench model --preset llama3-8b --out "$R"
    timeout 100 $fd bench model --preset llama3-8b --phases grad --grad-accum 4 --modes peft_lora flashdora \
      --tag accum4 --out "$R"
    timeout 150 $fd bench model --preset llama3-8b --modes peft_lora flashdora --compile --reps 3 --tag compile \
      --out "$R"
    timeout 200 $fd parity --size base --rank 384 --dropout 0.05 --dtype autocast --steps 80 --seeds 3 \
      --batch 8 --seq 512 --lr 1e-4 --out "$R"
    ;;
  c)
    timeout 100 python3 -m pytest -m gpu tests -q -p no:cacheprovider -k "compiles or rounds or graph_replays" 2>&1 \
      | tail -3 | tee "$R/pytest_gpu.txt"
    timeout 150 $fd bench model --preset llama3-8b --layers 8 --modes peft_lora flashdora --reps 4 --rounds 3 \
      --tag eager-8l --out "$R"
    timeout 300 $fd bench model --preset llama3-8b --layers 8 --modes peft_lora flashdora --reps 5 --compile \
      --tag compile-8l --out "$R"
    ;;
  d)
    timeout 240 python3 benchmarks/norm_variants.py --out "$R" 2>&1 | tee "$R/norm_variants.txt"
    timeout 300 $fd bench layer --ranks 384 --tokens 2048 --dtypes autocast --tag r384 --out "$R"
    ;;
  e)
    timeout 580 $fd bench model --preset qwen2.5-32b --modes base peft_lora peft_dora flashdora --out "$R"
    ;;
  f)
    timeout 170 python3 -m pytest -m gpu tests/kernels/test_norm.py tests/ops/test_norm_cache.py -q -p no:cacheprovider \
      2>&1 | tail -8 | tee "$R/pytest_gpu.txt"
    timeout 150 python3 benchmarks/norm_variants.py --old .out/old_norm.py --out "$R" 2>&1 | tee "$R/norm_variants.txt"
    timeout 120 $fd bench layer --ranks 384 --tokens 2048 --dtypes autocast --tag r384 --out "$R"
    timeout 150 $fd bench model --preset llama3-8b --modes peft_lora peft_dora flashdora --out "$R"
    ;;
  g)
    timeout 120 python3 -m pytest -m gpu tests/kernels/test_norm.py tests/ops/test_norm_cache.py -q -p no:cacheprovider \
      2>&1 | tail -30 | tee "$R/pytest_gpu.txt"
    timeout 90 python3 benchmarks/norm_variants.py --out "$R" 2>&1 | tee "$R/norm_variants.txt"
    timeout 120 $fd bench layer --ranks 384 --tokens 2048 --dtypes autocast --tag r384 --out "$R"
    timeout 140 $fd bench model --preset llama3-8b --modes peft_lora peft_dora flashdora --rounds 2 --out "$R"
    timeout 120 $fd bench model --preset llama3-8b --phases grad --grad-accum 4 --modes peft_lora flashdora \
      --rounds 2 --tag accum4 --out "$R"
    ;;
  s)
    timeout 150 python3 benchmarks/norm_variants.py --shapes 8192x28672 4096x14336 --sweep --out "$R" 2>&1 \
      | tee "$R/norm_variants.txt"
    timeout 300 python3 benchmarks/profile_model.py --preset qwen2.5-32b --layers 4 --phases grad --top 30 --cprofile \
      --cpu-ops 2>&1 | tee "$R/profile_qwen.txt"
    ;;
  v)
    timeout 170 python3 -m pytest -m gpu tests/kernels/test_norm.py tests/ops tests/test_peft_integration.py \
      tests/test_compile.py -q -p no:cacheprovider 2>&1 | tail -30 | tee "$R/pytest_gpu.txt"
    timeout 60 python3 benchmarks/norm_variants.py --shapes 8192x28672 5120x27648 4096x14336 --out "$R" 2>&1 \
      | tee "$R/norm_variants.txt"
    timeout 150 $fd bench layer --ranks 384 --tokens 2048 --dtypes autocast --tag r384 --out "$R"
    timeout 150 $fd bench model --preset llama3-8b --modes peft_lora peft_dora flashdora --out "$R"
    ;;
  i)
    timeout 150 python3 benchmarks/profile_model.py --preset llama3-8b --layers 4 --phases inference grad --top 12 2>&1 \
      | tee "$R/profile_8b.txt"
    timeout 300 $fd bench model --preset llama3-8b --modes peft_lora flashdora --rounds 2 --out "$R"
    ;;
  m)
    timeout 200 python3 -m pytest -m gpu tests/ops tests/kernels/test_compose.py -q -p no:cacheprovider 2>&1 \
      | tail -5 | tee "$R/pytest_gpu.txt"
    timeout 200 $fd bench layer --shapes 5120x27648 8192x28672 4096x14336 --ranks 384 --tokens 2048 --dtypes autocast \
      --tag r384-mem --out "$R"
    ;;
  n)
    timeout 580 $fd bench model --preset qwen2.5-32b --modes peft_lora flashdora --phases grad --rounds 2 \
      --tag qwen-grad --out "$R"
    ;;
  p)
    seed=${2:?usage: gpu_run.sh p SEED}
    timeout 580 $fd parity --pretrain 800 --rank 384 --dropout 0.05 --dtype autocast --steps 2000 --seeds 1 \
      --first-seed "$seed" --batch 8 --seq 512 --lr 1e-4 --floor --tag "2000p-s$seed" --out "$R" 2>&1 \
      | tee "$R/parity-s$seed.txt"
    ;;
  w)
    timeout 170 python3 -m pytest -m gpu tests/kernels tests/ops tests/test_peft_integration.py -q \
      -p no:cacheprovider 2>&1 | tail -30 | tee "$R/pytest_gpu.txt"
    timeout 40 python3 benchmarks/norm_variants.py --shapes 8192x28672 --repeat 7 2>&1 | tee "$R/norm_repeat.txt"
    timeout 150 $fd bench layer --ranks 384 --tokens 2048 --dtypes autocast --tag r384 --out "$R"
    for src in ${OLD_SRC:+"$OLD_SRC"} src; do  # A/B: an older source tree (carried, e.g. .out/old/src) first
      PYTHONPATH=$src timeout 80 python3 benchmarks/profile_model.py --preset llama3-8b --layers 4 \
        --phases inference grad --top 6 2>&1 | tee -a "$R/profile_8b.txt"
    done
    timeout 40 python3 benchmarks/probe_launch.py 2>&1 | tee "$R/probe_launch.txt"
    ;;
  x)
    timeout 280 python3 benchmarks/alloc_stats.py --preset llama3-8b --grad-accum 4 --steps 5 2>&1 \
      | tee "$R/alloc_stats.txt"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 280 python3 benchmarks/alloc_stats.py \
      --preset llama3-8b --grad-accum 4 --steps 5 --runs peft_lora flashdora 2>&1 | tee -a "$R/alloc_stats.txt"
    ;;
  y)
    timeout 200 python3 -m pytest -m gpu tests/kernels tests/ops tests/test_peft_integration.py \
      tests/test_peft_autocast.py tests/test_compile.py -q -p no:cacheprovider 2>&1 | tail -30 | tee "$R/pytest_gpu.txt"
    timeout 200 $fd bench model --preset llama3-8b --modes peft_lora peft_dora flashdora --rounds 2 --out "$R"
    timeout 120 $fd bench layer --ranks 384 --tokens 2048 --dtypes autocast --tag r384 --out "$R"
    timeout 60 python3 benchmarks/host_layer.py --turns 5 2>&1 | tee "$R/host_layer.txt"
    ;;
  h)
    timeout 200 python3 -m pytest -m gpu tests/kernels/test_norm.py tests/ops tests/test_peft_integration.py \
      tests/test_compile.py -q -p no:cacheprovider 2>&1 | tail -30 | tee "$R/pytest_gpu.txt"
    timeout 90 python3 benchmarks/norm_variants.py --out "$R" 2>&1 | tee "$R/norm_variants.txt"
    timeout 150 $fd bench layer --ranks 384 --tokens 2048 --dtypes autocast --tag r384 --out "$R"
    ;;
esac
tar -C "$OUT" -cf "$OUT/results.tar" results && rm -rf "$R"
