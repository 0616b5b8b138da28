# Sanitizer and fuzzing builds (scripts/sanitize.sh, scripts/fuzz.sh).
#
# ZT_SANITIZE: a comma-separated list for -fsanitize= (e.g. "address,undefined"). It instruments
# zerotrain's own code (library, CLI, tests, benchmarks); LibTorch comes prebuilt from the wheel
# and is not instrumented. The flags are added for every target so that the library's precompiled
# header stays valid everywhere (see the top-level CMakeLists.txt). UBSan findings are made fatal
# (-fno-sanitize-recover) so a report fails the test that triggered it.
#
# ZT_FUZZ: libFuzzer targets under fuzz/ (clang only). Every target is compiled with
# -fsanitize=fuzzer-no-link plus address and undefined; the fuzz executables add -fsanitize=fuzzer.
set(ZT_SANITIZE "" CACHE STRING "Sanitizers for zerotrain's own code, e.g. address,undefined (empty: none)")
option(ZT_FUZZ "Build the libFuzzer targets under fuzz/ (needs clang)" OFF)

if(ZT_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ZT_FUZZ needs clang (libFuzzer): configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  if(ZT_SANITIZE STREQUAL "")
    set(ZT_SANITIZE "address,undefined")
  endif()
endif()

if(NOT ZT_SANITIZE STREQUAL "")
  if(NOT ZT_SANITIZE MATCHES "^[a-z,]+$")
    message(FATAL_ERROR "ZT_SANITIZE: expected a comma-separated list such as address,undefined, found '${ZT_SANITIZE}'")
  endif()
  set(_zt_san_flags -fsanitize=${ZT_SANITIZE} -fno-omit-frame-pointer -g)
  if(ZT_SANITIZE MATCHES "undefined")
    # vptr checks need RTTI of LibTorch's classes across the uninstrumented boundary: false
    # positives there, and our own code has no downcasts for them to guard.
    list(APPEND _zt_san_flags -fno-sanitize-recover=undefined -fno-sanitize=vptr)
  endif()
  if(ZT_FUZZ)
    list(APPEND _zt_san_flags -fsanitize=fuzzer-no-link)
  endif()
  foreach(flag ${_zt_san_flags})
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:${flag}>)
  endforeach()
  add_link_options(-fsanitize=${ZT_SANITIZE})
  if(ZT_SANITIZE MATCHES "undefined")
    add_link_options(-fno-sanitize=vptr)
  endif()
endif()
