#include "zerotrain/version.h"

namespace zt {
const char* version() { return "0.1.0"; }
}  // namespace zt
