// SplitMix64's finaliser: a bijective, well-mixing 64-bit function (Steele et al.). The samplers
// chain it over (seed, step, sample) so that every sample gets its own stream, with no state to
// save for a resume and no rank depending on another. Internal to src/data.
#pragma once
#include <cstdint>

namespace zt {

inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace zt
