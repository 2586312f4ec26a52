// The BERT normalizer of Hugging Face tokenizers (normalizers/bert.rs), on code points.
#ifndef COLLABSERVE_SERVER_TEXT_BERT_NORMALIZER_H_
#define COLLABSERVE_SERVER_TEXT_BERT_NORMALIZER_H_

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
// `out` must not alias the input. Thread-safe; allocates only to grow `out`.
void BertNormalize(const char32_t* begin, const char32_t* end, const BertNormalizerOptions& options,
                   std::vector<char32_t>* out);

}  // namespace collabserve::text

#endif  // COLLABSERVE_SERVER_TEXT_BERT_NORMALIZER_H_
