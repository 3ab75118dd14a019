# kvcodec_module(NAME name [DEPS module...] [LIBS target...] [TEST_LIBS target...])
#
# Declares one layer of the library from the folder it is called in:
#   - a static library kvcodec_<name> from every *.cpp in src/<name>/;
#   - a GoogleTest executable test_<name> from every *.cpp in tests/<name>/,
#     registered with ctest (one executable per module, DESIGN 12).
# DEPS are other modules (lower layers only); LIBS are external targets.
# kvcodec_test_options(target): what every unit-test executable is compiled
# with beyond the library's flags. KVCODEC_TEST_CXX_FLAGS (top-level
# CMakeLists.txt) last, so it wins. In a fuzz build the libraries carry
# libFuzzer's coverage instrumentation (-fsanitize=fuzzer-no-link) for the
# fuzz targets; a test needs none, and it costs compile time.
function(kvcodec_test_options target)
  if(KVCODEC_FUZZ)
    target_compile_options(${target} PRIVATE -fno-sanitize=fuzzer-no-link)
  endif()
  if(KVCODEC_TEST_CXX_FLAGS)
    separate_arguments(test_flags UNIX_COMMAND "${KVCODEC_TEST_CXX_FLAGS}")
    target_compile_options(${target} PRIVATE ${test_flags})
  endif()
endfunction()

function(kvcodec_module)
  cmake_parse_arguments(M "" "NAME" "DEPS;LIBS;TEST_LIBS" ${ARGN})
  file(GLOB sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  set(target kvcodec_${M_NAME})
  add_library(${target} STATIC ${sources})
  target_include_directories(${target} PUBLIC ${CMAKE_SOURCE_DIR}/src)
  target_link_libraries(${target} PUBLIC kvcodec_headers)
  foreach(dep IN LISTS M_DEPS)
    target_link_libraries(${target} PUBLIC kvcodec_${dep})
  endforeach()
  if(M_LIBS)
    target_link_libraries(${target} PUBLIC ${M_LIBS})
  endif()

  set(test_dir ${CMAKE_SOURCE_DIR}/tests/${M_NAME})
  if(KVCODEC_TESTS AND EXISTS ${test_dir}
     AND (KVCODEC_TEST_MODULES STREQUAL "all" OR M_NAME IN_LIST KVCODEC_TEST_MODULES))
    file(GLOB test_sources CONFIGURE_DEPENDS ${test_dir}/*.cpp)
    if(test_sources)
      add_executable(test_${M_NAME} ${test_sources})
      target_link_libraries(test_${M_NAME} PRIVATE ${target} GTest::gtest GTest::gtest_main ${M_TEST_LIBS})
      target_include_directories(test_${M_NAME} PRIVATE ${CMAKE_SOURCE_DIR}/tests)
      kvcodec_test_options(test_${M_NAME})
      target_compile_definitions(test_${M_NAME} PRIVATE
        KVCODEC_SHARED_DIR="${KVCODEC_SHARED_DIR}"
        KVCODEC_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
      gtest_discover_tests(test_${M_NAME} DISCOVERY_TIMEOUT 60 PROPERTIES LABELS ${M_NAME})
    endif()
  endif()
endfunction()
