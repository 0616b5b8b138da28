// Internal invariant checks: a violated one is a bug in zerotrain, never bad user input, and is
// reported as a zt::Error naming the condition instead of aborting the process.
#pragma once
#include <string>

#include "zerotrain/error.h"

#define ZT_CHECK_STATE(cond, message)                                                      \
  do {                                                                                     \
    if (!(cond))                                                                           \
      throw ::zt::Error(std::string("internal error: ") + (message) + " (" #cond ") at " + \
                        __FILE__ + ":" + std::to_string(__LINE__));                        \
  } while (0)
