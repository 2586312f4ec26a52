#include "server/text/bert_normalizer.h"

#include "server/text/unicode.h"

namespace collabserve::text {

void BertNormalize(const char32_t* begin, const char32_t* end, const BertNormalizerOptions& options,
                   std::vector<char32_t>* out, std::vector<uint32_t>* sources) {
  using namespace unicode;  // NOLINT: the property bits
  const size_t first = out->size();
  // Each code point appended from here on came from *p.
  auto track = [&](const char32_t* p) {
    if (sources != nullptr) sources->resize(out->size(), static_cast<uint32_t>(p - begin));
  };
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
    track(p);
  }
  if (options.strip_accents) {
    // Canonical ordering must come before dropping the marks: a dropped mark of class 0 can
    // separate two runs that would otherwise be sorted together.
    if (any_combining && sources == nullptr) {
      CanonicalOrder(out->data() + first, out->data() + out->size());
    } else if (any_combining) {
      // Hugging Face's alignments through NFD (unicode-normalization-alignments, then
      // NormalizedString::transform): the first code point from each input character "replaces"
      // the next character of the text, the others are "new" and take the alignment of the last
      // character replaced; reordering moves those roles with the code points, not the sources.
      std::vector<uint32_t> replaced, is_new(out->size() - first);
      for (size_t i = first; i < out->size(); ++i) {
        is_new[i - first] = i > first && (*sources)[i] == (*sources)[i - 1];
        if (!is_new[i - first]) replaced.push_back((*sources)[i]);
      }
      CanonicalOrder(out->data() + first, out->data() + out->size(), is_new.data());
      size_t k = 0;
      uint32_t last = replaced.empty() ? 0 : replaced[0];
      for (size_t i = first; i < out->size(); ++i) {
        if (!is_new[i - first] && k < replaced.size()) last = replaced[k++];
        (*sources)[i] = last;
      }
    }
    if (any_mark) {
      size_t w = first;
      for (size_t r = first; r < out->size(); ++r) {
        if (Properties((*out)[r]) & kNonspacingMark) continue;
        if (sources != nullptr) (*sources)[w] = (*sources)[r];
        (*out)[w++] = (*out)[r];
      }
      out->resize(w);
      if (sources != nullptr) sources->resize(w);
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
      std::vector<uint32_t> tail_sources;
      if (sources != nullptr) tail_sources.assign(sources->begin() + first, sources->end());
      out->resize(first);
      if (sources != nullptr) sources->resize(first);
      for (size_t i = 0; i < tail.size(); ++i) {
        AppendLowercase(tail[i], out);
        if (sources != nullptr) sources->resize(out->size(), tail_sources[i]);
      }
    }
  }
}

}  // namespace collabserve::text
