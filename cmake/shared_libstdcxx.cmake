# One C++ runtime per process. LibTorch (and Python's torch) link the shared
# libstdc++.so.6; a toolchain that has only libstdc++.a (seen on a lent H200
# machine: /opt/gcc's g++ wrapper) copies a private libstdc++ into every
# library it links. Two copies then share one process, std::locale facet ids
# disagree between them, and the first number written to a std::ostream
# (c10::str in a TORCH_CHECK or TORCH_WARN message) calls a wrong virtual:
# a segfault far from the cause. So where the compiler has no libstdc++.so,
# link the libstdc++.so.6 it does know about (the system's, the one torch
# loads) and, where the driver accepts it, keep the static archive out.
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  return()
endif()
execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
  OUTPUT_VARIABLE _zeroshard_libstdcxx_so OUTPUT_STRIP_TRAILING_WHITESPACE)
if(IS_ABSOLUTE "${_zeroshard_libstdcxx_so}" AND EXISTS "${_zeroshard_libstdcxx_so}")
  return()  # the usual case: -lstdc++ finds the shared library
endif()
if(NOT ZEROSHARD_SHARED_LIBSTDCXX)  # -DZEROSHARD_SHARED_LIBSTDCXX=... wins
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
    OUTPUT_VARIABLE _zeroshard_compiler_libstdcxx_so6 OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(IS_ABSOLUTE "${_zeroshard_compiler_libstdcxx_so6}"
     AND EXISTS "${_zeroshard_compiler_libstdcxx_so6}")
    set(ZEROSHARD_SHARED_LIBSTDCXX "${_zeroshard_compiler_libstdcxx_so6}")
  else()
    # The compiler answers with the bare name when it knows none.
    find_library(ZEROSHARD_SHARED_LIBSTDCXX NAMES libstdc++.so.6)
  endif()
endif()
if(NOT ZEROSHARD_SHARED_LIBSTDCXX)
  message(FATAL_ERROR
    "${CMAKE_CXX_COMPILER} has no shared libstdc++ (libstdc++.so) and no libstdc++.so.6 was "
    "found: linking libstdc++.a into zeroshard would put a second C++ runtime beside torch's "
    "and crash at run time. Use a compiler with a shared libstdc++ (set CXX), install "
    "libstdc++6, or pass -DZEROSHARD_SHARED_LIBSTDCXX=/path/to/libstdc++.so.6.")
endif()
include(CheckLinkerFlag)
check_linker_flag(CXX -nostdlib++ ZEROSHARD_LINKER_HAS_NOSTDLIBXX)
if(ZEROSHARD_LINKER_HAS_NOSTDLIBXX)
  add_link_options(-nostdlib++)
endif()
link_libraries(${ZEROSHARD_SHARED_LIBSTDCXX})
message(STATUS "${CMAKE_CXX_COMPILER} has only a static libstdc++: linking "
  "${ZEROSHARD_SHARED_LIBSTDCXX} instead, so zeroshard shares torch's C++ runtime")
