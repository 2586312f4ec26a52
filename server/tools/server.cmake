# build/bin/collabserve: the gRPC server. Included from server/tools/CMakeLists.txt when
# COLLABSERVE_WITH_GRPC is ON.
add_executable(collabserve ${CMAKE_CURRENT_LIST_DIR}/collabserve_main.cc)
target_link_libraries(collabserve PRIVATE collabserve_service collabserve_model
  absl::flags absl::flags_parse absl::flags_usage absl::strings glog::glog)
