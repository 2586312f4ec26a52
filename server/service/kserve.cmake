# collabserve_kserve: the Open Inference Protocol (KServe v2, inference.GRPCInferenceService) on
# top of collabserve_service, its REST form (kserve_http.h) and text-embeddings-inference's REST API (tei_http.h). Include it after server/service/CMakeLists.txt has defined
# collabserve_service (e.g. from server/service/CMakeLists.txt or a test); paths are relative to
# this file, and including it twice is harmless.
if(NOT TARGET collabserve_kserve)
  include(${CMAKE_CURRENT_LIST_DIR}/../../proto/kserve.cmake)
  add_library(collabserve_kserve ${CMAKE_CURRENT_LIST_DIR}/kserve_service.cc
                                ${CMAKE_CURRENT_LIST_DIR}/kserve_http.cc
                                ${CMAKE_CURRENT_LIST_DIR}/tei_http.cc)
  target_link_libraries(collabserve_kserve
    PUBLIC collabserve_service collabserve_kserve_proto collabserve_metrics
           collabserve_repository gRPC::grpc++ absl::synchronization glog::glog
    PRIVATE absl::strings absl::status absl::statusor nlohmann_json::nlohmann_json)
endif()
