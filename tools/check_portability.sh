#!/usr/bin/env bash
# Run a pytest selection under every CPU kernel set torch offers here and both MKL modes, so a test
# that passes only with this machine's kernels (vector unit, MKL code path) fails here too.
#
#   tools/check_portability.sh                      # the kernel-sensitive subset (what CI runs)
#   tools/check_portability.sh tests -q             # the whole suite, six times (the full matrix)
#
# Kernel sets: ATEN_CPU_CAPABILITY=default (no vector unit), avx2 and the native one (unset);
# MKL: its default dispatch and MKL_CBWR=COMPATIBLE (reproducible, conservative code path).
# ATen ignores a capability the CPU lacks (it falls back), so the matrix is safe on any x86 or ARM.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -eq 0 ]; then
  # Bitwise claims and derived fp32 bounds: the tests whose results depend on the kernels.
  # The native kernel set with MKL's default is the README's test run itself, so it is skipped here.
  set -- tests/distributed/test_parallel_training.py tests/distributed/test_expert_parallel.py \
         tests/unit/test_model.py tests/unit/test_fp4_moeresq.py tests/unit/test_batch_invariant.py \
         tests/unit/test_fp4_exact_gemm.py tests/distributed/test_batch_invariant_layouts.py tests/unit/test_numerics_levels.py \
         tests/unit/test_attention_causal.py tests/unit/test_moe_grouped.py \
         tests/integration/test_gpt_oss_parity.py tests/integration/test_deepseek_v3_parity.py \
         tests/unit/test_family_numerics_levels.py tests/unit/test_packed_batches.py -q -p no:cacheprovider \
         -k "fp32_layout or ep2_matches or kv_cache or batch_invariant or float64 or bitwise or same_bits or fp32_bound or moeresq_loop or batch_level or tiled or block_attention or logits_match"
  SKIP_NATIVE_DEFAULT=1
fi
status=0
for cap in default avx2 native; do
  for cbwr in default COMPATIBLE; do
    if [ "${SKIP_NATIVE_DEFAULT:-0}" = 1 ] && [ "$cap" = native ] && [ "$cbwr" = default ]; then continue; fi
    env_cap=(); [ "$cap" != native ] && env_cap=(ATEN_CPU_CAPABILITY="$cap")
    env_mkl=(); [ "$cbwr" != default ] && env_mkl=(MKL_CBWR="$cbwr")
    echo "=== ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr: pytest $*"
    env "${env_cap[@]}" "${env_mkl[@]}" python -m pytest "$@"
    rc=$?
    # pytest exits 5 when the selection collects nothing: a broken selection, not a pass.
    if [ "$rc" -ne 0 ]; then echo "=== FAILED (exit $rc) under ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr"; status=1; fi
  done
done
exit "$status"
