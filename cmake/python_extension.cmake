# zeroshard._C: the pybind11 bindings, linked to the core library, compiled
# with the flags torch.utils.cpp_extension gives an extension of this torch.
# The pybind11 ABI tag must be torch's own, or pybind11 types torch binds
# (ProcessGroup, Work) would not pass between torch._C and zeroshard._C;
# torch 2.11 leaves it to pybind11's headers (no flags), older ones pass it.
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import sysconfig, warnings; warnings.simplefilter('ignore'); import torch.utils.cpp_extension as e; print(';'.join(getattr(e, '_get_pybind11_abi_build_flags', list)())); print(sysconfig.get_config_var('EXT_SUFFIX'))"
  OUTPUT_VARIABLE ZEROSHARD_PYTHON_PROBE
  OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE ZEROSHARD_PYTHON_PROBE_RESULT)
if(NOT ZEROSHARD_PYTHON_PROBE_RESULT EQUAL 0)
  message(FATAL_ERROR "Could not ask ${Python3_EXECUTABLE} for torch's pybind11 flags; "
    "the Python extension needs the interpreter whose torch it is built against")
endif()
string(REPLACE "\n" ";" ZEROSHARD_PYTHON_PROBE "${ZEROSHARD_PYTHON_PROBE}")
list(POP_BACK ZEROSHARD_PYTHON_PROBE ZEROSHARD_PYTHON_EXT_SUFFIX)
set(ZEROSHARD_PYBIND11_ABI_FLAGS ${ZEROSHARD_PYTHON_PROBE})

find_library(TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib"
  NO_DEFAULT_PATH REQUIRED)

add_library(zeroshard_python MODULE
  csrc/bindings/module.cpp
  csrc/bindings/module_checkpoint.cpp
  csrc/bindings/module_engine.cpp
  csrc/bindings/options_from_python.cpp
  csrc/bindings/module_estimator.cpp
  csrc/bindings/module_hooks.cpp
  csrc/bindings/module_host_kernel.cpp
  csrc/bindings/module_update_rules.cpp
)
target_link_libraries(zeroshard_python PRIVATE zeroshard ${TORCH_PYTHON_LIBRARY} Python3::Module)
target_compile_definitions(zeroshard_python PRIVATE TORCH_EXTENSION_NAME=_C
  TORCH_API_INCLUDE_EXTENSION_H)
target_compile_options(zeroshard_python PRIVATE -fvisibility=hidden ${ZEROSHARD_PYBIND11_ABI_FLAGS})
# The core library travels next to the extension, which finds it through
# $ORIGIN (in place, in a wheel, in site-packages alike); torch's own
# libraries are already loaded by `import torch`.
set_target_properties(zeroshard_python PROPERTIES
  OUTPUT_NAME _C
  PREFIX ""
  SUFFIX "${ZEROSHARD_PYTHON_EXT_SUFFIX}"
  LIBRARY_OUTPUT_DIRECTORY "${ZEROSHARD_PYTHON_PACKAGE_DIR}"
  BUILD_WITH_INSTALL_RPATH ON
  INSTALL_RPATH "$ORIGIN")
add_custom_command(TARGET zeroshard_python POST_BUILD
  COMMAND ${CMAKE_COMMAND} -E copy_if_different $<TARGET_FILE:zeroshard>
    "${ZEROSHARD_PYTHON_PACKAGE_DIR}/$<TARGET_FILE_NAME:zeroshard>"
  VERBATIM)
