# collabserve_kserve_proto: C++ messages and gRPC stubs for proto/kserve/grpc_predict_v2.proto (the
# Open Inference Protocol, package `inference`). Included from proto/CMakeLists.txt; usable from
# anywhere (paths are relative to this file). Generated headers: "kserve/grpc_predict_v2.grpc.pb.h".
if(NOT TARGET collabserve_kserve_proto)
  set(_kserve_proto ${CMAKE_CURRENT_LIST_DIR}/kserve/grpc_predict_v2.proto)
  set(_kserve_gen_dir ${CMAKE_BINARY_DIR}/proto/gen-kserve)
  set(_kserve_outs ${_kserve_gen_dir}/kserve/grpc_predict_v2.pb.cc
                   ${_kserve_gen_dir}/kserve/grpc_predict_v2.pb.h
                   ${_kserve_gen_dir}/kserve/grpc_predict_v2.grpc.pb.cc
                   ${_kserve_gen_dir}/kserve/grpc_predict_v2.grpc.pb.h)
  add_custom_command(
    OUTPUT ${_kserve_outs}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${_kserve_gen_dir}
    COMMAND ${Protobuf_PROTOC_EXECUTABLE}
      --proto_path=${CMAKE_CURRENT_LIST_DIR}
      --cpp_out=${_kserve_gen_dir}
      --grpc_out=${_kserve_gen_dir}
      --plugin=protoc-gen-grpc=$<TARGET_FILE:gRPC::grpc_cpp_plugin>
      ${_kserve_proto}
    DEPENDS ${_kserve_proto} gRPC::grpc_cpp_plugin
    COMMENT "protoc kserve/grpc_predict_v2.proto"
    VERBATIM)
  add_library(collabserve_kserve_proto ${_kserve_outs})
  # Generated code is not ours to warn about.
  target_compile_options(collabserve_kserve_proto PRIVATE -w)
  target_include_directories(collabserve_kserve_proto PUBLIC ${_kserve_gen_dir})
  target_link_libraries(collabserve_kserve_proto PUBLIC protobuf::libprotobuf gRPC::grpc++)
endif()
