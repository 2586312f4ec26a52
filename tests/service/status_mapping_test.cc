#include "server/service/status_mapping.h"

#include "gtest/gtest.h"

namespace collabserve::service {
namespace {

TEST(StatusMappingTest, KeepsCodeAndMessage) {
  const absl::Status cases[] = {
      absl::InvalidArgumentError("inputs[0].text is empty"), absl::NotFoundError("no model x"),
      absl::ResourceExhaustedError("queue full"), absl::DeadlineExceededError("late"),
      absl::UnavailableError("draining"), absl::CancelledError("gone"),
      absl::InternalError("bug"), absl::FailedPreconditionError("state")};
  for (const absl::Status& s : cases) {
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), static_cast<int>(s.code()));
    EXPECT_EQ(g.error_message(), s.message());
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
}

TEST(StatusMappingTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(StatusMappingTest, CodeNamesAreTheCanonicalOnes) {
  EXPECT_EQ(CodeName(grpc::StatusCode::OK), "OK");
  EXPECT_EQ(CodeName(grpc::StatusCode::RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(CodeName(grpc::StatusCode::DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
}

}  // namespace
}  // namespace collabserve::service
