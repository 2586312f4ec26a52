#include "server/text/bert_pre_tokenizer.h"

#include "server/text/unicode.h"

namespace collabserve::text {

void BertPreTokenize(const char32_t* text, size_t size, std::vector<WordSpan>* words) {
  size_t word_start = 0;
  for (size_t i = 0; i < size; ++i) {
    const uint8_t bits = unicode::Properties(text[i]);
    if (bits & (unicode::kWhitespace | unicode::kPunctuation)) {
      if (word_start < i) words->emplace_back(word_start, i);
      if (bits & unicode::kPunctuation) words->emplace_back(i, i + 1);
      word_start = i + 1;
    }
  }
  if (word_start < size) words->emplace_back(word_start, size);
}

}  // namespace collabserve::text
