# ctest driver: installs the current build into a fresh prefix, then configures, builds and runs
# the consumer project against it. Variables: BUILD_DIR, CONSUMER_DIR, WORK_DIR, GENERATOR,
# CXX_COMPILER, and CUDA_ROOT when the library was built with CUDA.
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${command}\n${out}")
  endif()
  message("${out}")
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
set(cuda_hint)
if(CUDA_ROOT)
  set(cuda_hint "-DCUDAToolkit_ROOT=${CUDA_ROOT}")
endif()
step(${CMAKE_COMMAND} -S "${CONSUMER_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
     -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER} "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" ${cuda_hint})
step(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
step("${WORK_DIR}/build/consumer")
if(EXISTS "${WORK_DIR}/build/consumer_nccl")
  step("${WORK_DIR}/build/consumer_nccl")
endif()
