// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status code (abseil 20220623 has none public).
#ifndef COLLABSERVE_SERVER_UTIL_STATUS_MACROS_H_
#define COLLABSERVE_SERVER_UTIL_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

#endif  // COLLABSERVE_SERVER_UTIL_STATUS_MACROS_H_
