# Sourced by the bench/gpu_*.sh scripts: `LOG=name gpu_setup` -> logs to $OUT/name, defines
# `stage`, installs axplug and its plugins (and wheels brought in .whl/: the GPU host has no
# network) and prints the GPU and jax version.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/$LOG") 2>&1

stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S)) ==="; }

stage setup
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . \
  $(for d in plugins/*/; do printf -- '-e %s ' "$d"; done) 2>&1 | grep -v "^\s*$" | tail -3
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
