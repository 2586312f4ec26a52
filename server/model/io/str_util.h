// String helpers internal to io/. Debian's abseil is built with its own absl::string_view (not
// std::string_view), so absl::StrCat does not accept std::string_view; Cat() converts first.
#ifndef COLLABSERVE_SERVER_MODEL_IO_STR_UTIL_H_
#define COLLABSERVE_SERVER_MODEL_IO_STR_UTIL_H_

#include <cstdint>
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

// True if `s` is well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF), as
// Python requires of a pickled str.
inline bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int n;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xe0) == 0xc0) { n = 1; cp = c & 0x1f; }
    else if ((c & 0xf0) == 0xe0) { n = 2; cp = c & 0x0f; }
    else if ((c & 0xf8) == 0xf0) { n = 3; cp = c & 0x07; }
    else return false;
    if (i + n >= s.size()) return false;  // truncated sequence
    for (int k = 1; k <= n; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    static const uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

}  // namespace collabserve::model::io::internal

#endif  // COLLABSERVE_SERVER_MODEL_IO_STR_UTIL_H_
