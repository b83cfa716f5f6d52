// Which instruction set runs the update: read from CPUID (and XGETBV, for the operating
// system's support of the wider registers) when asked, overridable by INFINITY_SIMD.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "adam.h"

namespace infinity::adam {

enum class Simd : uint8_t { kScalar, kAvx2, kAvx512 };

const char* simd_name(Simd simd);

// The paths this CPU and OS can run, best first; kScalar is always last.
std::vector<Simd> available_simd();

// "" means: the INFINITY_SIMD environment variable if set (read on every call, so tests can
// change it), else the best available path. "auto" means the best available path. Returns
// false with a reason for an unknown name or a path this CPU lacks.
bool resolve_simd(const std::string& name, Simd* out, std::string* why);

KernelFn kernel_for(Simd simd);
StreamFn stream_for(Simd simd);

}  // namespace infinity::adam
