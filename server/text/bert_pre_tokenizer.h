// The BERT pre-tokenizer of Hugging Face tokenizers (pre_tokenizers/bert.rs), on code points.
#ifndef COLLABSERVE_SERVER_TEXT_BERT_PRE_TOKENIZER_H_
#define COLLABSERVE_SERVER_TEXT_BERT_PRE_TOKENIZER_H_

#include <cstddef>
#include <utility>
#include <vector>

namespace collabserve::text {

// A word: code points [begin, end) of the pre-tokenized text.
using WordSpan = std::pair<size_t, size_t>;

// Splits [0, size) of `text` on whitespace (Rust char::is_whitespace; removed), then isolates every
// punctuation character (ASCII punctuation or a Unicode P* category) as a word of its own. Appends
// the non-empty words, in order, to `words`. Thread-safe.
void BertPreTokenize(const char32_t* text, size_t size, std::vector<WordSpan>* words);

}  // namespace collabserve::text

#endif  // COLLABSERVE_SERVER_TEXT_BERT_PRE_TOKENIZER_H_
