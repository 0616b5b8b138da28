#pragma once

namespace zt {
// The library version, as in the CMake project.
const char* version();
}  // namespace zt
