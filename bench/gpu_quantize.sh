#!/usr/bin/env bash
# Quantized training and activation offload on one NVIDIA GPU, in one run of a few minutes:
# bench/quantized_matmul.py (which GEMMs XLA picks for int8 / fp8, and their speed against
# bf16), bench/train_variants.py on a 0.5B LLaMA (bf16 with dot-saving remat, int8, the fp8
# recipes, full remat, offload), bench/fp8_recipes.py (each recipe's loss against float), and
# the GPU numerics tests.
#
#   OUT=gpu-out bash bench/gpu_quantize.sh
LOG=quantize.log source "$(dirname "$0")/gpu_setup.sh"

stage "quantized matmuls: [8192x4096] @ [4096x4096], forward + both gradients"
timeout 120 "$PY" bench/quantized_matmul.py --rounds 5 --reps 20

BIG=(--set model.decoder.dim=2048 --set model.decoder.transformer.num_layers=8
     --set model.decoder.transformer.layer.attention.num_heads=16
     --set model.decoder.transformer.layer.feed_forward.hidden_dim=5632
     --set model.decoder.vocab_size=32000 --set input.seq_len=1024 --set input.batch_size=8)
COMMON=compute_dtype:dtype=bfloat16+flash_attention
stage "train_variants: 0.5B LLaMA, seq 1024 x batch 8"
timeout 420 "$PY" bench/train_variants.py "${BIG[@]}" --rounds 3 --steps 3 \
  --variant "dots=scan_layers:remat_policy=dots+$COMMON" \
  --variant "int8=scan_layers:remat_policy=dots+$COMMON+quantize:int8" \
  --variant "fp8=scan_layers:remat_policy=dots+$COMMON+quantize:fp8" \
  --variant "fp8_tensorwise=scan_layers:remat_policy=dots+$COMMON+quantize:fp8_tensorwise" \
  --variant "fp8_rowwise=scan_layers:remat_policy=dots+$COMMON+quantize:fp8_rowwise" \
  --variant "mxfp8=scan_layers:remat_policy=dots+$COMMON+quantize:mxfp8" \
  --variant "full=scan_layers:remat_policy=full+$COMMON" \
  --variant "offload=scan_layers:remat_policy=offload+$COMMON"

stage "fp8 recipes against float: llama-tiny, 100 steps each"
timeout 240 "$PY" bench/fp8_recipes.py --steps 100

stage "GPU kernel numerics (pytest -m gpu)"
JAX_PLATFORMS=cuda timeout 120 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/ 2>&1 | tail -15
stage done
