# collabserve_admin: the Admin gRPC service (uploads compressed as tracked jobs, version
# management, bearer-token auth, admin metrics) and its flags. Include from
# server/service/CMakeLists.txt; usable from anywhere (paths are relative to this file).
if(NOT TARGET collabserve_admin)
  include(${CMAKE_CURRENT_LIST_DIR}/../../proto/admin.cmake)
  find_package(OpenSSL REQUIRED)
  find_package(OpenMP REQUIRED)
  add_library(collabserve_admin
    ${CMAKE_CURRENT_LIST_DIR}/admin_auth.cc
    ${CMAKE_CURRENT_LIST_DIR}/admin_metrics.cc
    ${CMAKE_CURRENT_LIST_DIR}/admin_upload.cc
    ${CMAKE_CURRENT_LIST_DIR}/admin_jobs.cc
    ${CMAKE_CURRENT_LIST_DIR}/admin_service.cc
    ${CMAKE_CURRENT_LIST_DIR}/admin_server.cc
    ${CMAKE_CURRENT_LIST_DIR}/admin_flags.cc)
  target_link_libraries(collabserve_admin
    PUBLIC collabserve_admin_proto collabserve_service collabserve_repository collabserve_compress
           collabserve_model collabserve_util gRPC::grpc++ absl::status absl::statusor
           absl::synchronization glog::glog
    PRIVATE OpenSSL::Crypto OpenMP::OpenMP_CXX prometheus-cpp::core absl::flags absl::strings
            absl::str_format absl::time)
endif()

# collabctl's admin commands (client/collabctl_admin.cc): link into collabctl.
if(NOT TARGET collabctl_admin)
  find_package(OpenSSL REQUIRED)
  add_library(collabctl_admin ${CMAKE_CURRENT_LIST_DIR}/../../client/collabctl_admin.cc)
  target_link_libraries(collabctl_admin
    PUBLIC collabserve_admin_proto gRPC::grpc++
    PRIVATE OpenSSL::Crypto absl::flags absl::strings absl::str_format absl::time)
endif()
