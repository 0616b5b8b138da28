// Precompiled header for the library, CLI, tests and benchmarks: LibTorch dominates compile time
// (docs/design.md "Platform facts"), so it is parsed once here. Public headers include only what
// they need.
#pragma once
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
