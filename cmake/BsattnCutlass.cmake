# CUTLASS / CuTe headers come from the pinned PyPI package nvidia-cutlass (scripts/setup.sh
# installs it); they are never vendored. Override with -DCUTLASS_INCLUDE_DIR=...
set(BSATTN_CUTLASS_VERSION 4.2.0.0)
if(NOT CUTLASS_INCLUDE_DIR)
  find_package(Python3 COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_VARIABLE _cutlass_include OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _cutlass_rc ERROR_QUIET)
  if(NOT _cutlass_rc EQUAL 0 OR NOT EXISTS "${_cutlass_include}/cute/tensor.hpp")
    message(FATAL_ERROR "CUTLASS headers not found: pip install nvidia-cutlass==${BSATTN_CUTLASS_VERSION} "
                        "(scripts/setup.sh does), or pass -DCUTLASS_INCLUDE_DIR, or -DBSATTN_ENABLE_CUDA=OFF")
  endif()
  set(CUTLASS_INCLUDE_DIR "${_cutlass_include}" CACHE PATH "CUTLASS/CuTe include directory")
endif()
message(STATUS "bsattn: CUTLASS headers from ${CUTLASS_INCLUDE_DIR}")
add_library(bsattn_cutlass INTERFACE)
target_include_directories(bsattn_cutlass SYSTEM INTERFACE ${CUTLASS_INCLUDE_DIR})
