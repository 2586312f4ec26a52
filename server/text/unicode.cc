#include "server/text/unicode.h"

#include <algorithm>
#include <array>
#include <map>
#include <tuple>
#include <utility>

namespace collabserve::text::unicode {
namespace {

constexpr char32_t kHangulFirst = 0xAC00, kHangulLast = 0xD7A3;
constexpr char32_t kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr int kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount;

// A two-stage lookup table built once from the ranges: a block index per 256 code points, and the
// distinct 256-entry blocks (a few hundred). Two loads per lookup instead of a binary search.
class PropertyTable {
 public:
  PropertyTable() {
    std::map<std::array<uint8_t, kBlock>, uint16_t> seen;
    std::array<uint8_t, kBlock> block;
    size_t range = 0;
    for (uint32_t b = 0; b < kNumBlocks; ++b) {
      for (uint32_t i = 0; i < kBlock; ++i) {
        const char32_t c = b * kBlock + i;
        while (range + 1 < kNumPropertyRanges && kPropertyRanges[range + 1].start <= c) ++range;
        block[i] = kPropertyRanges[range].bits;
      }
      auto [it, inserted] = seen.emplace(block, static_cast<uint16_t>(blocks_.size() / kBlock));
      if (inserted) blocks_.insert(blocks_.end(), block.begin(), block.end());
      index_[b] = it->second;
    }
  }
  uint8_t Get(char32_t c) const {
    return blocks_[size_t{index_[c / kBlock]} * kBlock + c % kBlock];
  }

 private:
  static constexpr uint32_t kBlock = 256, kNumBlocks = 0x110000 / kBlock;
  std::array<uint16_t, kNumBlocks> index_;
  std::vector<uint8_t> blocks_;
};

const PropertyTable& Table() {
  static const PropertyTable* const table = new PropertyTable();
  return *table;
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
  return Table().Get(c);
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

void CanonicalOrder(char32_t* begin, char32_t* end, uint32_t* payload) {
  char32_t* p = begin;
  while (p != end) {
    if (CanonicalCombiningClass(*p) == 0) {
      ++p;
      continue;
    }
    char32_t* run_end = p;
    while (run_end != end && CanonicalCombiningClass(*run_end) != 0) ++run_end;
    if (run_end - p > 1 && payload == nullptr) {
      std::stable_sort(p, run_end, [](char32_t a, char32_t b) {
        return CanonicalCombiningClass(a) < CanonicalCombiningClass(b);
      });
    } else if (run_end - p > 1) {
      uint32_t* values = payload + (p - begin);
      std::vector<std::pair<char32_t, uint32_t>> run;
      for (char32_t* q = p; q != run_end; ++q) run.emplace_back(*q, values[q - p]);
      std::stable_sort(run.begin(), run.end(), [](const auto& a, const auto& b) {
        return CanonicalCombiningClass(a.first) < CanonicalCombiningClass(b.first);
      });
      for (size_t i = 0; i < run.size(); ++i) std::tie(p[i], values[i]) = run[i];
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
