// Strict UTF-8 decoding and encoding for the tokenizer.
#ifndef COLLABSERVE_SERVER_TEXT_UTF8_H_
#define COLLABSERVE_SERVER_TEXT_UTF8_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace collabserve::text {

// Appends the code points of `text` to `out`. Returns INVALID_ARGUMENT, naming the byte offset and
// the problem, for anything that is not well-formed UTF-8 (RFC 3629): stray continuation bytes,
// truncated sequences, overlong encodings, surrogates (U+D800..U+DFFF), values above U+10FFFF, and
// bytes C0, C1, F5..FF. On error `out` holds the code points before the bad byte.
absl::Status DecodeUtf8(std::string_view text, std::vector<char32_t>* out);

// Appends the UTF-8 encoding of `c` (a Unicode scalar value) to `out`.
void AppendUtf8(char32_t c, std::string* out);

}  // namespace collabserve::text

#endif  // COLLABSERVE_SERVER_TEXT_UTF8_H_
