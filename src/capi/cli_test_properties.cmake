# Read by ctest after test_capi's discovered tests (TEST_INCLUDE_FILES in
# this folder's CMakeLists.txt); capi_cli_tests lists the CapiWithCli.* ones.
# gtest_discover_tests (CMake 3.25) flattens a list in its PROPERTIES:
# LABELS "capi;slow" became LABELS capi, so these ran under the sanitizers.
foreach(t IN LISTS capi_cli_tests)
  set_tests_properties("${t}" PROPERTIES LABELS "capi;slow")
endforeach()
# One `kvcodec calibrate` for the two calibrated tests: the setup test makes
# KVCODEC_TEST_CALIBRATION (capi_test_util.hpp's calibration_path()), the
# other reuses it; run side by side at -j2, each made its own.
list(FIND capi_cli_tests CapiWithCli.CalibratedCacheErrors setup)
list(FIND capi_cli_tests CapiWithCli.CalibratedKvtcThroughASharedCalibration user)
if(setup GREATER -1 AND user GREATER -1)
  set_tests_properties(CapiWithCli.CalibratedCacheErrors PROPERTIES FIXTURES_SETUP capi_calibration)
  set_tests_properties(CapiWithCli.CalibratedKvtcThroughASharedCalibration PROPERTIES FIXTURES_REQUIRED capi_calibration)
endif()
