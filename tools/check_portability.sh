#!/usr/bin/env bash
# Run a pytest selection under other CPU kernel sets and MKL modes than the machine's own, so a test
# that passes only with this machine's kernels (vector unit, MKL code path) fails here too.
#
#   tools/check_portability.sh                      # the kernel-sensitive subset, two combined modes (what CI runs)
#   tools/check_portability.sh tests -q             # the whole suite under the full matrix (six modes)
#   PORTABILITY_MODES="default:COMPATIBLE" tools/check_portability.sh tests/unit -q   # modes of your choice
#
# Kernel sets: ATEN_CPU_CAPABILITY=default (no vector unit), avx2 and the native one (unset);
# MKL: its default dispatch and MKL_CBWR=COMPATIBLE (reproducible, conservative code path). A mode is
# CAPABILITY:MKL_CBWR, `native` / `default` meaning "unset". ATen ignores a capability the CPU lacks
# (it falls back), so every mode is safe on any x86 or ARM. oneDNN (the `batch` level's wide fp32
# GEMMs, fp4/row_calls.py) follows the capability: avx2 sets ONEDNN_MAX_CPU_ISA=AVX2, default SSE41
# (its oldest x86 kernels; ignored elsewhere).
#
# CI's subset runs two modes that each change both factors: default:COMPATIBLE (no vector unit, MKL's
# reproducible GEMMs) and avx2:COMPATIBLE (the AVX2 ATen kernels where the machine has AVX-512; MKL's
# reproducible GEMMs, which on an AMD EPYC also differ from those under default:COMPATIBLE); native:default
# is the suite's own run. Each mode's line shows the capability ATen chose and a digest of an fp32
# GEMM and a log_softmax, so the log says whether the mode really ran other kernels than native.
# (Measured on an AMD EPYC with AVX-512: all three GEMMs differ, and both ATen sets' log_softmax.)
set -uo pipefail
cd "$(dirname "$0")/.."
# The full matrix; native:default is the README's own test run.
default_modes="default:default default:COMPATIBLE avx2:default avx2:COMPATIBLE native:default native:COMPATIBLE"
if [ "$#" -eq 0 ]; then
  # Bitwise claims and derived fp32 bounds: the tests whose results depend on the kernels.
  set -- tests/distributed/test_parallel_training.py tests/distributed/test_expert_parallel.py \
         tests/unit/test_model.py tests/unit/test_fp4_moeresq.py tests/unit/test_batch_invariant.py \
         tests/unit/test_fp4_exact_gemm.py tests/distributed/test_batch_invariant_layouts.py tests/unit/test_numerics_levels.py \
         tests/unit/test_attention_causal.py tests/unit/test_moe_grouped.py \
         tests/integration/test_gpt_oss_parity.py tests/integration/test_deepseek_v3_parity.py \
         tests/unit/test_family_numerics_levels.py tests/unit/test_packed_batches.py tests/unit/test_row_calls.py \
         tests/unit/test_block_attention_tall.py tests/unit/test_block_attention_decode.py \
         -q -p no:cacheprovider \
         -k "fp32_layout or ep2_matches or kv_cache or batch_invariant or float64 or bitwise or same_bits or fp32_bound or moeresq_loop or batch_level or tiled or block_attention or logits_match or height or packed"
  default_modes="default:COMPATIBLE avx2:COMPATIBLE"  # CI's: each changes both factors (see above)
fi
modes="${PORTABILITY_MODES:-$default_modes}"
probe='import hashlib, torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
a, b, x = torch.randn(67, 131, generator=g), torch.randn(131, 45, generator=g), 7 * torch.randn(4096, generator=g)
d = lambda t: hashlib.sha1(t.numpy().tobytes()).hexdigest()[:8]
print(f"ATen {torch.backends.cpu.get_cpu_capability()}, gemm {d(a @ b)}, log_softmax {d(torch.log_softmax(x, 0))}")'
echo "=== native kernels: $(python -c "$probe")"
status=0
for mode in $modes; do
  cap="${mode%%:*}"; cbwr="${mode#*:}"
  env_cap=(); [ "$cap" != native ] && env_cap=(ATEN_CPU_CAPABILITY="$cap")
  [ "$cap" = avx2 ] && env_cap+=(ONEDNN_MAX_CPU_ISA=AVX2)
  [ "$cap" = default ] && env_cap+=(ONEDNN_MAX_CPU_ISA=SSE41)
  env_mkl=(); [ "$cbwr" != default ] && env_mkl=(MKL_CBWR="$cbwr")
  echo "=== ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr ${env_cap[*]:1} ($(env "${env_cap[@]}" "${env_mkl[@]}" python -c "$probe")): pytest $*"
  env "${env_cap[@]}" "${env_mkl[@]}" python -m pytest "$@"
  rc=$?
  # pytest exits 5 when the selection collects nothing: a broken selection, not a pass.
  if [ "$rc" -ne 0 ]; then echo "=== FAILED (exit $rc) under ATEN_CPU_CAPABILITY=$cap MKL_CBWR=$cbwr"; status=1; fi
done
exit "$status"
