# Locates the TensorRT C++ headers (NvInfer.h, 10.x) without a TensorRT installation. Sets DHS_HAVE_TENSORRT
# and DHS_TENSORRT_INCLUDE_DIR. Looks at, in order: -DDHS_TENSORRT_INCLUDE_DIR, $TENSORRT_INCLUDE_DIR, the
# `kernel_lens` Python package (pip install --no-deps kernel-lens==2.0.1), .tools/kernel-lens, /usr/include.
set(DHS_HAVE_TENSORRT OFF)
set(DHS_TENSORRT_INCLUDE_DIR "" CACHE PATH "Folder holding NvInfer.h")
if(DHS_ENABLE_TENSORRT)
  set(hints ${DHS_TENSORRT_INCLUDE_DIR} $ENV{TENSORRT_INCLUDE_DIR})
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
              "import importlib.util as u; s = u.find_spec('kernel_lens'); print(s.submodule_search_locations[0] if s else '')"
      OUTPUT_VARIABLE kernel_lens_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(kernel_lens_dir)
      list(APPEND hints ${kernel_lens_dir}/include/tensorrt)
    endif()
  endif()
  list(APPEND hints ${PROJECT_SOURCE_DIR}/.tools/kernel-lens/kernel_lens/include/tensorrt)
  find_path(DHS_TENSORRT_FOUND_DIR NvInferRuntime.h HINTS ${hints} PATHS /usr/include/x86_64-linux-gnu /usr/include
            NO_CACHE)
  if(DHS_TENSORRT_FOUND_DIR)
    set(DHS_TENSORRT_INCLUDE_DIR ${DHS_TENSORRT_FOUND_DIR} CACHE PATH "Folder holding NvInfer.h" FORCE)
    file(STRINGS ${DHS_TENSORRT_FOUND_DIR}/NvInferVersion.h trt_major REGEX "define TRT_MAJOR_ENTERPRISE ")
    message(STATUS "dhisparse: TensorRT headers in ${DHS_TENSORRT_FOUND_DIR} (${trt_major})")
    set(DHS_HAVE_TENSORRT ON)
  else()
    message(STATUS "dhisparse: TensorRT headers not found, plugins are skipped")
  endif()
endif()
