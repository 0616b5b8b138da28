#include "zerotrain/config/recompute.h"

namespace zt {

const char* to_string(Recompute recompute) {
  switch (recompute) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

}  // namespace zt
