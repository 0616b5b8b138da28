// Typed errors. Every message names the input, what was expected and what was found.
// The CLI prints what() as one line on stderr; ConfigError/DataError exit with code 2 (bad user
// input, nothing started), everything else with 1.
#pragma once
#include <stdexcept>
#include <string>

namespace zt {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad configuration or command-line input, detected before any work starts.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Missing or malformed data files.
class DataError : public Error {
 public:
  using Error::Error;
};

// A collective failed or timed out; the message names label, sequence number and rank.
class CommError : public Error {
 public:
  using Error::Error;
};

}  // namespace zt
