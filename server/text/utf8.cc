#include "server/text/utf8.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace collabserve::text {
namespace {

absl::Status Invalid(size_t offset, uint8_t byte, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrFormat("invalid UTF-8 at byte offset %d (byte 0x%02X): %s", offset, byte, problem));
}

}  // namespace

absl::Status DecodeUtf8(std::string_view text, std::vector<char32_t>* out) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t b0 = s[i];
    if (b0 < 0x80) {
      out->push_back(b0);
      ++i;
      continue;
    }
    int len;
    char32_t c;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b0 < 0xC0) return Invalid(i, b0, "unexpected continuation byte");
    if (b0 < 0xC2) return Invalid(i, b0, "overlong encoding");
    if (b0 < 0xE0) {
      len = 2;
      c = b0 & 0x1F;
    } else if (b0 < 0xF0) {
      len = 3;
      c = b0 & 0x0F;
      if (b0 == 0xE0) lo = 0xA0;  // below: overlong
      if (b0 == 0xED) hi = 0x9F;  // above: surrogates
    } else if (b0 < 0xF5) {
      len = 4;
      c = b0 & 0x07;
      if (b0 == 0xF0) lo = 0x90;  // below: overlong
      if (b0 == 0xF4) hi = 0x8F;  // above: beyond U+10FFFF
    } else {
      return Invalid(i, b0, "byte never appears in UTF-8 (would encode beyond U+10FFFF)");
    }
    for (int k = 1; k < len; ++k) {
      if (i + k >= n) {
        return Invalid(i, b0,
                       absl::StrCat("truncated sequence: expected ", len, " bytes, got ", k));
      }
      const uint8_t b = s[i + k];
      if (b < 0x80 || b > 0xBF) {
        return Invalid(
            i, b0, absl::StrCat("truncated sequence: byte ", i + k, " is not a continuation byte"));
      }
      if (k == 1 && (b < lo || b > hi)) {
        if (b0 == 0xED) return Invalid(i, b0, "encodes a UTF-16 surrogate (U+D800..U+DFFF)");
        if (b0 == 0xF4) return Invalid(i, b0, "encodes a value beyond U+10FFFF");
        return Invalid(i, b0, "overlong encoding");
      }
      c = (c << 6) | (b & 0x3F);
    }
    out->push_back(c);
    i += len;
  }
  return absl::OkStatus();
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

}  // namespace collabserve::text
