#!/usr/bin/env bash
# The GPU checks issue 13 leaves open, prepared for the next session lent a device (one call,
# about 6 minutes on an H200; each step has its own time limit so one hang cannot eat the rest).
# Run in the repository root on the device:  bash docs/gpu/checks.sh
# Outputs go to $OUT (the device tool's folder) or /tmp/gpu_checks.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  git log --oneline -1; } > "$out/machine.txt" 2>&1

# 1. All of tests/compress, but the two tests that need 8 devices (about 3 minutes on an H200).
#    It holds what session 15 saw fail on the GPU (error feedback around the narrow casts,
#    orthogonalize's batched check, the blocked projection's reference product). Run serially,
#    those four files alone outran 150 s in session 17.
JAX_PLATFORMS=cuda,cpu timeout -s INT 240 python3 -m pytest -q -n 8 -p no:cacheprovider \
  tests/compress \
  --deselect tests/compress/test_select_sharded.py::test_topk_on_device_local_data_inside_shard_map_equals_outside \
  --deselect tests/compress/test_sketch_sharded.py::test_count_sketch_on_device_local_data_inside_shard_map_equals_outside \
  > "$out/pytest_compress.txt" 2>&1
tail -n 15 "$out/pytest_compress.txt"

# 2. The full compressor table at 256M elements (about 2 minutes). With BEFORE=<a git archive
#    of an older commit, carried to the device> the same rows of that tree are timed in the same
#    process, and ONLY=<regex> keeps the rows it matches.
timeout -s INT 200 python3 -m benchmarks.compressors --sizes 268435456 --mlp-hidden 0 \
  --repeats 5 ${BEFORE:+--tree "before=$BEFORE"} ${ONLY:+--only "$ONLY"} \
  > "$out/compressors.txt" 2>&1
cat "$out/compressors.txt"
