// BERT WordPiece tokenization that gives the same ids as Hugging Face's BertTokenizerFast (the Rust
// `tokenizers` crate): BertNormalizer, BertPreTokenizer, WordPiece, BertProcessing and LongestFirst
// truncation, with the special tokens matched in the input as BertTokenizerFast does.
#ifndef COLLABSERVE_SERVER_TEXT_BERT_TOKENIZER_H_
#define COLLABSERVE_SERVER_TEXT_BERT_TOKENIZER_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/text/wordpiece.h"

namespace collabserve::text {

struct TokenizerOptions {
  bool do_lower_case = true;
  // Unset: follows do_lower_case, as in Hugging Face.
  std::optional<bool> strip_accents;
  bool tokenize_chinese_chars = true;
  // The limit Encode applies when called with max_length <= 0. Must be >= 2.
  int model_max_length = 512;
  std::string unk_token = "[UNK]", sep_token = "[SEP]", pad_token = "[PAD]", cls_token = "[CLS]",
              mask_token = "[MASK]";
  // More special tokens (Hugging Face's additional_special_tokens, and the special entries of
  // tokenizer_config.json's added_tokens_decoder), matched in the input as the ones above are. Each
  // must be in the vocabulary.
  std::vector<std::string> additional_special_tokens;
  // false (Hugging Face's default): the special tokens above, written literally in the input
  // ("a [SEP] b"), become their ids, matched case-sensitively before normalization. true: they are
  // tokenized like any other text ("[", "sep", "]").
  bool split_special_tokens = false;
};

struct Encoding {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> token_type_ids;  // 0 for [CLS] a [SEP], 1 for b [SEP]
  bool truncated = false;
  // Length of input_ids (special tokens included) had nothing been truncated.
  int num_tokens_before_truncation = 0;
  // With EncodeOptions::offsets, one per id: the bytes [first, second) of its own text (text or
  // text_pair) it was tokenized from, Hugging Face's offsets (in bytes, as its Rust crate gives
  // them); (0, 0) for the [CLS] and [SEP] that Encode adds, which special_tokens_mask marks 1 (a
  // special token written in the text is 0 there and has its span, as in Hugging Face).
  std::vector<std::pair<int32_t, int32_t>> offsets;
  std::vector<uint8_t> special_tokens_mask;
};

struct EncodeOptions {
  // Counts the special tokens; <= 0 means the tokenizer's model_max_length.
  int max_length = 0;
  // When the result would be longer than max_length: cut it (true) or refuse it (Encode).
  bool truncate = true;
  // false: no [CLS] and [SEP] (Hugging Face's add_special_tokens=False); max_length counts none.
  bool add_special_tokens = true;
  // Fill Encoding::offsets and special_tokens_mask.
  bool offsets = false;
};

// Immutable after creation; all methods are thread-safe.
class BertTokenizer {
 public:
  // Loads `vocab_path` (vocab.txt: one token a line, the line number is the id; as Hugging Face's
  // reader, "\n" or "\r\n" ends a line and trailing whitespace is trimmed; a token that appears
  // twice maps to its later id) and, unless `tokenizer_config_path` is "", tokenizer_config.json:
  // the keys do_lower_case, strip_accents (bool or null), tokenize_chinese_chars, model_max_length
  // (values above 2^31-1, like Hugging Face's 1e30 "no limit", become 2^31-1),
  // unk/sep/pad/cls/mask_token (string or {"content": ...}; mask_token null or "" for none),
  // additional_special_tokens, added_tokens_decoder, tokenizer_class and split_special_tokens;
  // other keys are ignored. Errors name the file: NOT_FOUND for a missing file; INVALID_ARGUMENT
  // for an empty vocabulary, invalid UTF-8 in it, a special token missing from it, malformed JSON
  // or a key of the wrong type; UNIMPLEMENTED for what this tokenizer does not do: a
  // tokenizer_class other than BertTokenizer(Fast), and added tokens beyond vocab.txt or not
  // special (Hugging Face matches those in the text before WordPiece).
  static absl::StatusOr<std::unique_ptr<BertTokenizer>> FromFiles(
      const std::string& vocab_path, const std::string& tokenizer_config_path);

  // `dir`/vocab.txt plus `dir`/tokenizer_config.json and `dir`/special_tokens_map.json when they
  // exist (the latter's special tokens override the former's, as in Hugging Face) and
  // `dir`/added_tokens.json (each entry must be a special token at its vocab.txt id). A name that
  // exists but is not a readable file (a dangling link) is an error, not an absent file. A
  // tokenizer.json is not read: for BERT checkpoints it repeats vocab.txt and the added tokens
  // above, and Hugging Face's BertTokenizerFast lets tokenizer_config.json override its normalizer
  // settings anyway.
  static absl::StatusOr<std::unique_ptr<BertTokenizer>> FromDirectory(const std::string& dir);

  // Whether a checkpoint's tokenizer_class (tokenizer_config.json or config.json) tokenizes as
  // this class does: BertTokenizer and BertTokenizerFast.
  static bool IsSupportedClass(std::string_view tokenizer_class);

  // `vocab[i]` is the token of id i. INVALID_ARGUMENT if the vocabulary is empty or lacks one of
  // the special tokens (mask_token may be "" for none), or model_max_length < 2; UNIMPLEMENTED if
  // it lacks an additional special token (one added beyond the vocabulary).
  static absl::StatusOr<std::unique_ptr<BertTokenizer>> Create(std::vector<std::string> vocab,
                                                               TokenizerOptions options);

  // The word-piece ids of `text` (normalizer, pre-tokenizer, WordPiece), without [CLS]/[SEP].
  // INVALID_ARGUMENT, naming the byte offset, if `text` is not valid UTF-8.
  absl::StatusOr<std::vector<int32_t>> TokenizeToIds(std::string_view text) const;
  // The same as tokens (vocabulary strings).
  absl::StatusOr<std::vector<std::string>> Tokenize(std::string_view text) const;

  // [CLS] text [SEP], or [CLS] text [SEP] text_pair [SEP]. `max_length` counts the special tokens;
  // <= 0 means options().model_max_length. When the result would be longer: with `truncate`, the
  // word pieces are cut exactly as Hugging Face's LongestFirst strategy does (from the right; the
  // longer side first, see utils/truncation.rs); without, INVALID_ARGUMENT naming the length and
  // the limit. INVALID_ARGUMENT too if max_length is below the number of special tokens (2, or 3
  // for a pair) or either text is not valid UTF-8.
  absl::StatusOr<Encoding> Encode(std::string_view text, std::optional<std::string_view> text_pair,
                                  int max_length = 0, bool truncate = true) const;
  // The same with EncodeOptions: also without [CLS]/[SEP], and with offsets.
  absl::StatusOr<Encoding> Encode(std::string_view text, std::optional<std::string_view> text_pair,
                                  const EncodeOptions& options) const;

  // The text of `ids`, as Hugging Face's tokenizer.decode with BertTokenizerFast's decoder
  // (WordPiece, "##", cleanup): each token after the first joined with a space, or without its
  // "##" to the one before; within each token (so only where a token starts with the space added
  // before it) " ." " ?" " !" " ," " ' " " n't" " 'm" " do not" " 's" " 've" " 're" closed up as
  // tokenizers' cleanup does. With `skip_special_tokens`, the special tokens (the five and the
  // additional ones) are left out. INVALID_ARGUMENT, naming it, for an id outside
  // [0, vocab_size()) or one that a later line of the vocabulary shadows (Hugging Face drops both
  // silently), or once the text would pass `max_bytes`.
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                     bool skip_special_tokens = true,
                                     size_t max_bytes = std::numeric_limits<size_t>::max()) const;

  int32_t cls_id() const { return cls_id_; }
  int32_t sep_id() const { return sep_id_; }
  int32_t pad_id() const { return pad_id_; }
  int32_t unk_id() const { return unk_id_; }
  int32_t mask_id() const { return mask_id_; }  // -1 when mask_token is ""
  // The number of ids (lines of vocab.txt), which is the embedding size the model needs. It exceeds
  // the number of distinct tokens when the vocabulary repeats a token.
  int vocab_size() const { return static_cast<int>(vocab_.size()); }
  const TokenizerOptions& options() const { return options_; }
  // The token of `id`; "" when `id` is out of range.
  const std::string& IdToToken(int32_t id) const;
  // The id of `token`, or -1.
  int32_t TokenToId(const std::string& token) const { return wordpiece_.TokenToId(token); }

 private:
  BertTokenizer(std::vector<std::string> vocab, TokenizerOptions options, int32_t unk_id);
  // Appends the ids of `text` (and, with `offsets`, their byte spans in it).
  absl::Status AppendIds(std::string_view text, std::string_view what, std::vector<int32_t>* ids,
                         std::vector<std::pair<int32_t, int32_t>>* offsets = nullptr) const;
  // Appends the ids of code points [begin, end) of a text; with `offsets`, their byte spans too,
  // `bytes[i]` being the byte offset in the text of code point begin[i] (bytes[end - begin] its
  // end).
  void AppendSegmentIds(const char32_t* begin, const char32_t* end, std::vector<int32_t>* ids,
                        const uint32_t* bytes = nullptr,
                        std::vector<std::pair<int32_t, int32_t>>* offsets = nullptr) const;

  std::vector<std::string> vocab_;
  TokenizerOptions options_;
  WordPiece wordpiece_;
  int32_t unk_id_, cls_id_ = -1, sep_id_ = -1, pad_id_ = -1, mask_id_ = -1;
  // Special tokens matched in the input (empty when split_special_tokens), as UTF-32 with their
  // ids.
  std::vector<std::pair<std::u32string, int32_t>> special_tokens_;
  // For Decode, per id: kSpecialId if its token is a special token (the five and the additional
  // ones, matched in the input or not), kShadowedId if a later line of the vocabulary has the same
  // token.
  static constexpr uint8_t kSpecialId = 1, kShadowedId = 2;
  std::vector<uint8_t> id_flags_;
};

}  // namespace collabserve::text

#endif  // COLLABSERVE_SERVER_TEXT_BERT_TOKENIZER_H_
