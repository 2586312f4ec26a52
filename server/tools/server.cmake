# build/bin/collabserve: the gRPC server. Included from server/tools/CMakeLists.txt when
# COLLABSERVE_WITH_GRPC is ON.
add_executable(collabserve ${CMAKE_CURRENT_LIST_DIR}/collabserve_main.cc
  ${CMAKE_CURRENT_LIST_DIR}/log_flags.cc)
target_link_libraries(collabserve PRIVATE collabserve_service collabserve_model
  absl::flags absl::flags_parse absl::flags_usage absl::strings absl::synchronization glog::glog)
collabserve_link_allocator(collabserve)

# The serving benchmark's raw-engine ceiling (bench/serving/run_serving_bench.sh). Built here, not
# in bench/CMakeLists.txt, because bench/serving/ belongs to the server's owner.
if(COLLABSERVE_BUILD_BENCH)
  add_executable(serving_engine_peak ${CMAKE_SOURCE_DIR}/bench/serving/engine_peak.cc)
  target_link_libraries(serving_engine_peak PRIVATE collabserve_model absl::strings)
  collabserve_link_allocator(serving_engine_peak)
endif()
# The Admin service (server/service/admin.cmake defines collabserve_admin).
include(${CMAKE_SOURCE_DIR}/server/service/admin.cmake)
target_link_libraries(collabserve PRIVATE collabserve_admin collabserve_kserve)
