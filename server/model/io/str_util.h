// String helpers internal to io/. Debian's abseil is built with its own absl::string_view (not
// std::string_view), so absl::StrCat does not accept std::string_view; Cat() converts first.
#ifndef COLLABSERVE_SERVER_MODEL_IO_STR_UTIL_H_
#define COLLABSERVE_SERVER_MODEL_IO_STR_UTIL_H_

#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace collabserve::model::io::internal {

template <typename T>
const T& ToAlphaNumArg(const T& v) {
  return v;
}
inline absl::string_view ToAlphaNumArg(std::string_view v) { return absl::string_view(v.data(), v.size()); }

template <typename... T>
std::string Cat(const T&... v) {
  return absl::StrCat(ToAlphaNumArg(v)...);
}

// Printable form of untrusted bytes for error messages: at most `max` bytes, non-printables as \xNN.
inline std::string Printable(std::string_view s, size_t max = 64) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

// `s` without leading and trailing ASCII whitespace.
inline std::string_view StripWhitespace(std::string_view s) {
  auto space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace collabserve::model::io::internal

#endif  // COLLABSERVE_SERVER_MODEL_IO_STR_UTIL_H_
