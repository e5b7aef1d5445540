#!/usr/bin/env bash
# Everything axplug checks on one NVIDIA GPU, in one run of a few minutes (accelerator time is
# scarce): the GPU kernel numerics tests, NVML utilisation, a training run's logged MFU, and
# bench/gpu_step_time.py on a ~1B LLaMA with cuDNN flash attention and with XLA's.
#
#   OUT=gpu-out bash bench/gpu_session.sh      # logs and metrics land in $OUT
#
# Each stage has its own time limit and a failing stage does not stop the next. With no network
# on the GPU host, missing pure-Python wheels may be brought in .whl/ (installed to /tmp/site).
LOG=session.log source "$(dirname "$0")/gpu_setup.sh"

stage "GPU kernel numerics (pytest -m gpu)"
JAX_PLATFORMS=cuda timeout 150 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/ plugins/hw_gpu/tests/ 2>&1 | tail -15

stage "NVML utilisation through the device_utilization hook"
timeout 30 "$PY" - <<'EOF'
import jax
from axplug import registry
from axplug.trainer.hooks import HookRunner

runner = HookRunner(registry.plugin_manager())
print("busy percent now:", runner.first("device_utilization", devices=jax.devices()))
EOF

stage "training: logged MFU and the low-utilisation watchdog"
rm -rf /tmp/axplug-gpu-run
timeout 120 axplug train --preset llama-tiny --output-dir /tmp/axplug-gpu-run \
  --modifier flash_attention --modifier compute_dtype:dtype=bfloat16 \
  --set max_steps=60 --set log_every=10 --set checkpoint_every=60 \
  --set watchdog.min_mfu=0.9 --set watchdog.min_device_busy_percent=99.5 \
  --set watchdog.utilization_window=20 2>&1 | grep -v "^\s*$" | tail -20
cp /tmp/axplug-gpu-run/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
tail -2 /tmp/axplug-gpu-run/metrics.jsonl 2>/dev/null

stage "gpu_step_time: 0.95B LLaMA, seq 2048 x batch 8, cuDNN flash"
timeout 170 "$PY" bench/gpu_step_time.py --seq 2048 --rounds 3 --steps-per-round 5

stage "gpu_step_time: 0.95B LLaMA, seq 1024 x batch 8, einsum attention on both sides"
timeout 150 "$PY" bench/gpu_step_time.py --attention xla --no-flax --rounds 3 --steps-per-round 5

stage done
