#include "server/text/unicode.h"

#include <algorithm>

namespace collabserve::text::unicode {
namespace {

constexpr char32_t kHangulFirst = 0xAC00, kHangulLast = 0xD7A3;
constexpr char32_t kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr int kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount;

uint8_t LookUpProperties(char32_t c) {
  const PropertyRange* end = kPropertyRanges + kNumPropertyRanges;
  // The last range whose start is <= c.
  const PropertyRange* it = std::upper_bound(
      kPropertyRanges, end, c, [](char32_t v, const PropertyRange& r) { return v < r.start; });
  return (it - 1)->bits;
}

const Mapping* FindMapping(const Mapping* table, size_t n, char32_t c) {
  const Mapping* end = table + n;
  const Mapping* it =
      std::lower_bound(table, end, c, [](const Mapping& m, char32_t v) { return m.cp < v; });
  return (it != end && it->cp == c) ? it : nullptr;
}

}  // namespace

uint8_t NonAsciiProperties(char32_t c) {
  if (c > 0x10FFFF) return 0;
  return LookUpProperties(c);
}

void AppendDecomposition(char32_t c, std::vector<char32_t>* out) {
  if (c >= kHangulFirst && c <= kHangulLast) {
    const int s = static_cast<int>(c - kHangulFirst);
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out->push_back(kTBase + s % kTCount);
    return;
  }
  if (c >= 128 && (Properties(c) & kHasDecomposition)) {
    if (const Mapping* m = FindMapping(kDecompositions, kNumDecompositions, c)) {
      out->insert(out->end(), kMappingData + m->offset, kMappingData + m->offset + m->length);
      return;
    }
  }
  out->push_back(c);
}

uint8_t CanonicalCombiningClass(char32_t c) {
  if (c < 0x300 || !(Properties(c) & kHasCombiningClass)) return 0;
  const CombiningClass* end = kCombiningClasses + kNumCombiningClasses;
  const CombiningClass* it = std::lower_bound(
      kCombiningClasses, end, c, [](const CombiningClass& e, char32_t v) { return e.cp < v; });
  return (it != end && it->cp == c) ? it->ccc : 0;
}

void CanonicalOrder(char32_t* begin, char32_t* end) {
  char32_t* p = begin;
  while (p != end) {
    if (CanonicalCombiningClass(*p) == 0) {
      ++p;
      continue;
    }
    char32_t* run_end = p;
    while (run_end != end && CanonicalCombiningClass(*run_end) != 0) ++run_end;
    if (run_end - p > 1) {
      std::stable_sort(p, run_end, [](char32_t a, char32_t b) {
        return CanonicalCombiningClass(a) < CanonicalCombiningClass(b);
      });
    }
    p = run_end;
  }
}

void AppendLowercase(char32_t c, std::vector<char32_t>* out) {
  if (c < 128) {
    out->push_back(c >= 'A' && c <= 'Z' ? c + 32 : c);
    return;
  }
  if (Properties(c) & kHasLowercase) {
    if (const Mapping* m = FindMapping(kLowercase, kNumLowercase, c)) {
      out->insert(out->end(), kMappingData + m->offset, kMappingData + m->offset + m->length);
      return;
    }
  }
  out->push_back(c);
}

}  // namespace collabserve::text::unicode
