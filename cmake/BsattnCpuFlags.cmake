# CPU engine flags: AVX2 + FMA when the build machine runs them (the engine is built where it
# runs; set BSATTN_CPU_FLAGS to override, e.g. empty for a portable binary).
if(NOT DEFINED BSATTN_CPU_FLAGS)
  set(BSATTN_CPU_FLAGS -O3)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
    include(CheckCXXSourceRuns)
    set(CMAKE_REQUIRED_FLAGS "-mavx2 -mfma")
    check_cxx_source_runs("int main() { return (__builtin_cpu_supports(\"avx2\") && __builtin_cpu_supports(\"fma\")) ? 0 : 1; }"
                          BSATTN_HOST_HAS_AVX2)
    unset(CMAKE_REQUIRED_FLAGS)
    if(BSATTN_HOST_HAS_AVX2)
      list(APPEND BSATTN_CPU_FLAGS -mavx2 -mfma)
    endif()
  endif()
  set(BSATTN_CPU_FLAGS "${BSATTN_CPU_FLAGS}" CACHE STRING "Extra flags for the CPU engine")
endif()
