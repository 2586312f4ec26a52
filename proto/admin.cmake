# collabserve_admin_proto: C++ messages and gRPC stubs for proto/collabserve/v1/admin.proto.
# Included from proto/CMakeLists.txt; usable from anywhere (paths are relative to this file).
if(NOT TARGET collabserve_admin_proto)
  set(_admin_proto ${CMAKE_CURRENT_LIST_DIR}/collabserve/v1/admin.proto)
  set(_admin_gen_dir ${CMAKE_BINARY_DIR}/proto/gen-admin)
  set(_admin_outs ${_admin_gen_dir}/collabserve/v1/admin.pb.cc
                  ${_admin_gen_dir}/collabserve/v1/admin.pb.h
                  ${_admin_gen_dir}/collabserve/v1/admin.grpc.pb.cc
                  ${_admin_gen_dir}/collabserve/v1/admin.grpc.pb.h)
  add_custom_command(
    OUTPUT ${_admin_outs}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${_admin_gen_dir}
    COMMAND ${Protobuf_PROTOC_EXECUTABLE}
      --proto_path=${CMAKE_CURRENT_LIST_DIR}
      --cpp_out=${_admin_gen_dir}
      --grpc_out=${_admin_gen_dir}
      --plugin=protoc-gen-grpc=$<TARGET_FILE:gRPC::grpc_cpp_plugin>
      ${_admin_proto}
    DEPENDS ${_admin_proto} gRPC::grpc_cpp_plugin
    COMMENT "protoc collabserve/v1/admin.proto"
    VERBATIM)
  add_library(collabserve_admin_proto ${_admin_outs})
  # Generated code is not ours to warn about.
  target_compile_options(collabserve_admin_proto PRIVATE -w)
  target_include_directories(collabserve_admin_proto PUBLIC ${_admin_gen_dir})
  target_link_libraries(collabserve_admin_proto PUBLIC protobuf::libprotobuf gRPC::grpc++)
endif()
