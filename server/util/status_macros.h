// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status code (abseil 20220623 has none public), and
// util::Prefixed, for the context a caller adds to a status.
#ifndef COLLABSERVE_SERVER_UTIL_STATUS_MACROS_H_
#define COLLABSERVE_SERVER_UTIL_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define COLLABSERVE_CONCAT_INNER_(a, b) a##b
#define COLLABSERVE_CONCAT_(a, b) COLLABSERVE_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                                    \
  do {                                                           \
    ::absl::Status collabserve_status_ = (expr);                 \
    if (!collabserve_status_.ok()) return collabserve_status_;   \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns its status,
// else assigns (moves) the value to `lhs`, which may be a declaration (`auto x`).
#define ASSIGN_OR_RETURN(lhs, expr) \
  COLLABSERVE_ASSIGN_OR_RETURN_IMPL_(COLLABSERVE_CONCAT_(collabserve_statusor_, __LINE__), lhs, expr)
#define COLLABSERVE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                       \
  if (!tmp.ok()) return std::move(tmp).status();           \
  lhs = std::move(tmp).value()

namespace collabserve::util {

// `status` with `prefix` before its message, its code and payloads kept: a mark that a payload
// carries (model::IsDeviceFailure's) survives the context each caller adds. OK stays OK.
inline absl::Status Prefixed(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  absl::Status out(status.code(), absl::StrCat(prefix, status.message()));
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_STATUS_MACROS_H_
