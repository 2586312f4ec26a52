// The BERT normalizer of Hugging Face tokenizers (normalizers/bert.rs), on code points.
#ifndef COLLABSERVE_SERVER_TEXT_BERT_NORMALIZER_H_
#define COLLABSERVE_SERVER_TEXT_BERT_NORMALIZER_H_

#include <cstdint>
#include <vector>

namespace collabserve::text {

struct BertNormalizerOptions {
  bool handle_chinese_chars = true;
  bool strip_accents = true;
  bool lowercase = true;
};

// Appends the normalized form of [begin, end) to `out`, in tokenizers' order:
//   1. clean_text (always on, as in BertTokenizerFast): drop U+0000, U+FFFD and control characters
//      (Cc, Cf, Co except tab, LF, CR); map whitespace to ' '.
//   2. handle_chinese_chars: put ' ' before and after each CJK ideograph.
//   3. strip_accents: NFD (decomposition and canonical ordering of the whole text), then drop Mn.
//   4. lowercase: Rust's char::to_lowercase, character by character (so Σ is always σ).
// `out` must not alias the input. With `sources`, also appends to it, for each code point appended
// to `out`, the index in [begin, end) of the input code point it came from (the alignment that
// Hugging Face's NormalizedString keeps for offsets); `sources` must hold as many entries as `out`
// on entry. Thread-safe; without `sources` it allocates only to grow `out`.
void BertNormalize(const char32_t* begin, const char32_t* end, const BertNormalizerOptions& options,
                   std::vector<char32_t>* out, std::vector<uint32_t>* sources = nullptr);

}  // namespace collabserve::text

#endif  // COLLABSERVE_SERVER_TEXT_BERT_NORMALIZER_H_
