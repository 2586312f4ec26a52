// The WordPiece model of Hugging Face tokenizers (models/wordpiece): greedy longest-match-first.
#ifndef COLLABSERVE_SERVER_TEXT_WORDPIECE_H_
#define COLLABSERVE_SERVER_TEXT_WORDPIECE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace collabserve::text {

// Immutable after construction; Tokenize is thread-safe.
class WordPiece {
 public:
  // `vocab[i]` is the token of id i. A token that appears more than once maps to its LAST id, as in
  // Hugging Face (both its vocab.txt reader and the Python converter build a map line by line).
  // `unk_id` must be a valid id.
  WordPiece(const std::vector<std::string>& vocab, int32_t unk_id,
            std::string continuing_subword_prefix = "##", size_t max_input_chars_per_word = 100);

  // Appends the ids of `word` (UTF-8, `num_chars` code points) to `ids`: the longest vocabulary
  // prefix, then repeatedly the longest "##"-prefixed continuation. The whole word becomes the
  // single unk id when it has more than max_input_chars_per_word code points or some part has no
  // match. `scratch` is a caller-owned buffer reused across calls to avoid allocations.
  // With `piece_ends`, also appends the byte offset in `word` where each piece ends (the unk id:
  // the word's end).
  void Tokenize(std::string_view word, size_t num_chars, std::vector<int32_t>* ids,
                std::string* scratch, std::vector<size_t>* piece_ends = nullptr) const;

  // The id of `token`, or -1.
  int32_t TokenToId(const std::string& token) const;

 private:
  std::unordered_map<std::string, int32_t> vocab_;
  int32_t unk_id_;
  std::string prefix_;
  size_t max_input_chars_per_word_;
  // Byte lengths of the longest word-initial token and of the longest continuation (without the
  // prefix): longer candidates cannot match, so the search starts no longer than these.
  size_t max_initial_bytes_ = 0, max_continuation_bytes_ = 0;
};

}  // namespace collabserve::text

#endif  // COLLABSERVE_SERVER_TEXT_WORDPIECE_H_
