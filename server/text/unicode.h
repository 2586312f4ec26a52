// Unicode character data for the BERT tokenizer, exactly as Hugging Face tokenizers sees it (which
// mixes Unicode versions; see scripts/gen_unicode_tables.py), without ICU.
#ifndef COLLABSERVE_SERVER_TEXT_UNICODE_H_
#define COLLABSERVE_SERVER_TEXT_UNICODE_H_

#include <cstdint>
#include <vector>

#include "server/text/unicode_tables.h"

namespace collabserve::text::unicode {

// The PropertyBits of `c`:
//   kWhitespace: Rust char::is_whitespace (White_Space).
//   kControl: general category Cc, Cf or Co, except tab, LF and CR (tokenizers' is_control).
//   kPunctuation: ASCII punctuation or a P* category (tokenizers' is_bert_punc).
//   kNonspacingMark: category Mn. kCjkIdeograph: tokenizers' is_chinese_char ranges.
// Code points above U+10FFFF have no bits. Thread-safe; no allocation.
uint8_t NonAsciiProperties(char32_t c);
inline uint8_t Properties(char32_t c) {
  return c < 128 ? kAsciiProperties[c] : NonAsciiProperties(c);
}

// Appends the full canonical decomposition of `c` (itself if it has none; Hangul syllables
// algorithmically), without reordering.
void AppendDecomposition(char32_t c, std::vector<char32_t>* out);

// The canonical combining class of `c` (0 for starters).
uint8_t CanonicalCombiningClass(char32_t c);

// Sorts each run of non-starters in [begin, end) by combining class, stably: the canonical ordering
// step of NFD. With `payload`, the values payload[0, end - begin) move with their code points.
void CanonicalOrder(char32_t* begin, char32_t* end, uint32_t* payload = nullptr);

// Appends Rust's char::to_lowercase(c): one to three code points.
void AppendLowercase(char32_t c, std::vector<char32_t>* out);

}  // namespace collabserve::text::unicode

#endif  // COLLABSERVE_SERVER_TEXT_UNICODE_H_
