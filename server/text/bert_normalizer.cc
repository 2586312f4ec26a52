#include "server/text/bert_normalizer.h"

#include "server/text/unicode.h"

namespace collabserve::text {

void BertNormalize(const char32_t* begin, const char32_t* end, const BertNormalizerOptions& options,
                   std::vector<char32_t>* out) {
  using namespace unicode;  // NOLINT: the property bits
  const size_t first = out->size();
  bool any_combining = false, any_mark = false, any_upper = false;
  for (const char32_t* p = begin; p != end; ++p) {
    char32_t c = *p;
    uint8_t bits = Properties(c);
    if (c == 0 || c == 0xFFFD || (bits & kControl)) continue;
    if (bits & kWhitespace) {
      c = ' ';
      bits = Properties(c);
    }
    const bool cjk = options.handle_chinese_chars && (bits & kCjkIdeograph);
    if (cjk) out->push_back(' ');
    if (options.strip_accents && (bits & kHasDecomposition || (c >= 0xAC00 && c <= 0xD7A3))) {
      const size_t at = out->size();
      AppendDecomposition(c, out);
      for (size_t i = at; i < out->size(); ++i) {
        const uint8_t b = Properties((*out)[i]);
        any_combining |= (b & kHasCombiningClass) != 0;
        any_mark |= (b & kNonspacingMark) != 0;
        any_upper |= (b & kHasLowercase) != 0;
      }
    } else {
      out->push_back(c);
      any_combining |= (bits & kHasCombiningClass) != 0;
      any_mark |= (bits & kNonspacingMark) != 0;
      any_upper |= (bits & kHasLowercase) != 0;
    }
    if (cjk) out->push_back(' ');
  }
  if (options.strip_accents) {
    // Canonical ordering must come before dropping the marks: a dropped mark of class 0 can
    // separate two runs that would otherwise be sorted together.
    if (any_combining) CanonicalOrder(out->data() + first, out->data() + out->size());
    if (any_mark) {
      size_t w = first;
      for (size_t r = first; r < out->size(); ++r) {
        if (!(Properties((*out)[r]) & kNonspacingMark)) (*out)[w++] = (*out)[r];
      }
      out->resize(w);
    }
  }
  if (options.lowercase && any_upper) {
    // Lowercasing can lengthen the text (İ -> i + U+0307): rewrite the tail through a copy only
    // when some mapping is longer than one code point.
    bool expands = false;
    for (size_t i = first; i < out->size(); ++i) {
      char32_t c = (*out)[i];
      if (c < 128) {
        if (c >= 'A' && c <= 'Z') (*out)[i] = c + 32;
        continue;
      }
      if (!(Properties(c) & kHasLowercase)) continue;
      thread_local std::vector<char32_t> one;
      one.clear();
      AppendLowercase(c, &one);
      if (one.size() == 1) {
        (*out)[i] = one[0];
      } else {
        expands = true;
        break;
      }
    }
    if (expands) {
      std::vector<char32_t> tail(out->begin() + first, out->end());
      out->resize(first);
      for (char32_t c : tail) AppendLowercase(c, out);
    }
  }
}

}  // namespace collabserve::text
