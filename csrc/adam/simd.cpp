// Run-time CPU feature detection. A feature counts only when the CPU has it and the OS saves
// its registers on context switch (XCR0), which CPUID alone does not tell.
#include "simd.h"

#include <cpuid.h>

#include <cstdlib>

namespace infinity::adam {
namespace {

struct Features {
  bool avx2 = false;    // with FMA and F16C, as the AVX2 path uses them
  bool avx512 = false;  // F, BW, VL, DQ
};

uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

Features detect() {
  Features f;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool fma = ecx & (1u << 12), osxsave = ecx & (1u << 27), avx = ecx & (1u << 28),
             f16c = ecx & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;     // SSE and AVX state
  const bool os_zmm = (xcr0 & 0xE6) == 0xE6;   // plus opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_ymm || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  f.avx2 = fma && f16c && (ebx & (1u << 5));
  const uint32_t avx512_bits = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // F DQ BW VL
  f.avx512 = f.avx2 && os_zmm && (ebx & avx512_bits) == avx512_bits;
  return f;
}

const Features& features() {
  static const Features f = detect();
  return f;
}

}  // namespace

const char* simd_name(Simd simd) {
  switch (simd) {
    case Simd::kAvx512: return "avx512";
    case Simd::kAvx2: return "avx2";
    default: return "scalar";
  }
}

std::vector<Simd> available_simd() {
  std::vector<Simd> out;
  if (features().avx512) out.push_back(Simd::kAvx512);
  if (features().avx2) out.push_back(Simd::kAvx2);
  out.push_back(Simd::kScalar);
  return out;
}

bool resolve_simd(const std::string& name, Simd* out, std::string* why) {
  std::string wanted = name;
  std::string source = "simd";
  if (wanted.empty()) {
    const char* env = std::getenv("INFINITY_SIMD");
    wanted = env ? env : "";
    source = "INFINITY_SIMD";
  }
  const std::vector<Simd> available = available_simd();
  if (wanted.empty() || wanted == "auto") {
    *out = available.front();
    return true;
  }
  for (Simd simd : {Simd::kAvx512, Simd::kAvx2, Simd::kScalar}) {
    if (wanted != simd_name(simd)) continue;
    for (Simd have : available) {
      if (have == simd) {
        *out = simd;
        return true;
      }
    }
    *why = source + "=" + wanted + ": this CPU does not support it (best available: " +
           simd_name(available.front()) + ")";
    return false;
  }
  *why = source + "=" + wanted + ": unknown SIMD path (expected scalar, avx2, avx512 or auto)";
  return false;
}

KernelFn kernel_for(Simd simd) {
  switch (simd) {
    case Simd::kAvx512: return &update_avx512;
    case Simd::kAvx2: return &update_avx2;
    default: return &update_scalar;
  }
}

StreamFn stream_for(Simd simd) {
  switch (simd) {
    case Simd::kAvx512: return &stream_avx512;
    case Simd::kAvx2: return &stream_avx2;
    default: return &stream_scalar;
  }
}

}  // namespace infinity::adam
