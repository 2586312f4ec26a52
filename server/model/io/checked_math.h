// Overflow-checked integer arithmetic for bounds computations on untrusted sizes (internal to io/).
#ifndef COLLABSERVE_SERVER_MODEL_IO_CHECKED_MATH_H_
#define COLLABSERVE_SERVER_MODEL_IO_CHECKED_MATH_H_

#include <cstdint>

namespace collabserve::model::io::internal {

// Each returns false (leaving *out unspecified) when the exact result does not fit.
inline bool CheckedMul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool CheckedAdd(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}
inline bool CheckedMul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool CheckedAdd(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

}  // namespace collabserve::model::io::internal

#endif  // COLLABSERVE_SERVER_MODEL_IO_CHECKED_MATH_H_
