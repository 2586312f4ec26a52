#include "server/text/wordpiece.h"

#include <algorithm>
#include <utility>

namespace collabserve::text {

WordPiece::WordPiece(const std::vector<std::string>& vocab, int32_t unk_id,
                     std::string continuing_subword_prefix, size_t max_input_chars_per_word)
    : unk_id_(unk_id),
      prefix_(std::move(continuing_subword_prefix)),
      max_input_chars_per_word_(max_input_chars_per_word) {
  vocab_.reserve(vocab.size());
  for (size_t i = 0; i < vocab.size(); ++i) {
    const std::string& token = vocab[i];
    vocab_[token] = static_cast<int32_t>(i);
    max_initial_bytes_ = std::max(max_initial_bytes_, token.size());
    if (token.compare(0, prefix_.size(), prefix_) == 0) {
      max_continuation_bytes_ = std::max(max_continuation_bytes_, token.size() - prefix_.size());
    }
  }
}

int32_t WordPiece::TokenToId(const std::string& token) const {
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

void WordPiece::Tokenize(std::string_view word, size_t num_chars, std::vector<int32_t>* ids,
                         std::string* scratch, std::vector<size_t>* piece_ends) const {
  if (num_chars > max_input_chars_per_word_) {
    ids->push_back(unk_id_);
    if (piece_ends != nullptr) piece_ends->push_back(word.size());
    return;
  }
  const size_t first = ids->size();
  const size_t first_end = piece_ends != nullptr ? piece_ends->size() : 0;
  size_t start = 0;
  while (start < word.size()) {
    // The longest candidate that could be in the vocabulary, cut back to a code point boundary.
    size_t end =
        std::min(word.size(), start + (start == 0 ? max_initial_bytes_ : max_continuation_bytes_));
    while (end < word.size() && end > start && (static_cast<uint8_t>(word[end]) & 0xC0) == 0x80)
      --end;
    int32_t found = -1;
    while (start < end) {
      scratch->clear();
      if (start > 0) scratch->append(prefix_);
      scratch->append(word.data() + start, end - start);
      auto it = vocab_.find(*scratch);
      if (it != vocab_.end()) {
        found = it->second;
        break;
      }
      // Drop the last code point: step back over continuation bytes to its lead byte.
      do {
        --end;
      } while (end > start && (static_cast<uint8_t>(word[end]) & 0xC0) == 0x80);
    }
    if (found < 0) {
      ids->resize(first);
      ids->push_back(unk_id_);
      if (piece_ends != nullptr) {
        piece_ends->resize(first_end);
        piece_ends->push_back(word.size());
      }
      return;
    }
    ids->push_back(found);
    if (piece_ends != nullptr) piece_ends->push_back(end);
    start = end;
  }
}

}  // namespace collabserve::text
