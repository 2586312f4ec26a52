#include "server/text/bert_tokenizer.h"

#include <algorithm>
#include <limits>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/text/bert_normalizer.h"
#include "server/text/bert_pre_tokenizer.h"
#include "server/text/unicode.h"
#include "server/text/utf8.h"
#include "server/util/files.h"
#include "server/util/json_error.h"
#include "server/util/status_macros.h"

namespace collabserve::text {
namespace {

constexpr size_t kMaxVocabFileBytes = size_t{1} << 30;
constexpr size_t kMaxConfigFileBytes = size_t{64} << 20;

// Debian's abseil has its own string_view type, which StrCat does not take a std::string_view as.
absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Splits vocab.txt the way tokenizers' WordPiece::read_file does: BufRead::lines (ends at "\n",
// drops one "\r" before it, no empty line after a final "\n"), then str::trim_end.
absl::StatusOr<std::vector<std::string>> ParseVocab(const std::string& path,
                                                    const std::string& contents) {
  std::vector<std::string> vocab;
  std::vector<char32_t> cps;
  size_t pos = 0;
  while (pos < contents.size()) {
    size_t nl = contents.find('\n', pos);
    if (nl == std::string::npos) nl = contents.size();
    std::string_view line(contents.data() + pos, nl - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    cps.clear();
    absl::Status s = DecodeUtf8(line, &cps);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": line ", vocab.size() + 1, " (id ",
                                                     vocab.size(), "): ", s.message()));
    }
    size_t keep = cps.size();
    while (keep > 0 && (unicode::Properties(cps[keep - 1]) & unicode::kWhitespace)) --keep;
    if (keep == cps.size()) {
      vocab.emplace_back(line);
    } else {
      std::string trimmed;
      for (size_t i = 0; i < keep; ++i) AppendUtf8(cps[i], &trimmed);
      vocab.push_back(std::move(trimmed));
    }
    pos = nl + 1;
  }
  if (vocab.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": the vocabulary is empty"));
  return vocab;
}

// `s` cut to 80 bytes (at a UTF-8 character boundary) with "..." when longer: values quoted in
// error messages.
std::string Cut(std::string s) {
  if (s.size() <= 80) return s;
  size_t cut = 80;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

// Containers are not dumped into the message: dump() recurses once per nesting level, so a hostile
// file nested 30000 deep overflowed the stack (tests/fuzz/regressions/tokenizer_config_json).
// Long values are cut.
absl::Status WrongType(const std::string& path, const std::string& key, std::string_view want,
                       const nlohmann::json& got) {
  const std::string value = got.is_primitive() ? Cut(got.dump()) : std::string();
  return absl::InvalidArgumentError(absl::StrCat(path, ": \"", key, "\" must be ", AV(want),
                                                 ", not ", got.type_name(), value.empty() ? "" : " ",
                                                 value));
}

// A token that a file says was added to the vocabulary at `id` (added_tokens.json,
// tokenizer_config.json's added_tokens_decoder).
struct DeclaredToken {
  std::string file;
  std::string content;
  int64_t id = 0;
};

// A token written as a string or as a serialized AddedToken ({"content": ...}).
bool TokenContent(const nlohmann::json& j, std::string* out) {
  if (j.is_string()) {
    *out = j.get<std::string>();
    return true;
  }
  if (j.is_object()) {
    auto it = j.find("content");
    if (it != j.end() && it->is_string()) {
      *out = it->get<std::string>();
      return true;
    }
  }
  return false;
}

// Applies the keys of a tokenizer_config.json or special_tokens_map.json to `o`; the tokens it
// declares added go to `declared`.
absl::Status ApplyConfig(const std::string& path, TokenizerOptions* o,
                         std::vector<DeclaredToken>* declared) {
  ASSIGN_OR_RETURN(std::string contents, util::ReadFile(path, kMaxConfigFileBytes));
  nlohmann::json j = nlohmann::json::parse(contents, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return util::JsonSyntaxError(contents, path);
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  auto get_bool = [&](const char* key, bool* out) -> absl::Status {
    auto it = j.find(key);
    if (it == j.end()) return absl::OkStatus();
    if (!it->is_boolean()) return WrongType(path, key, "true or false", *it);
    *out = it->get<bool>();
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(get_bool("do_lower_case", &o->do_lower_case));
  RETURN_IF_ERROR(get_bool("tokenize_chinese_chars", &o->tokenize_chinese_chars));
  RETURN_IF_ERROR(get_bool("split_special_tokens", &o->split_special_tokens));
  if (auto it = j.find("strip_accents"); it != j.end()) {
    if (it->is_null()) {
      o->strip_accents.reset();
    } else if (it->is_boolean()) {
      o->strip_accents = it->get<bool>();
    } else {
      return WrongType(path, "strip_accents", "true, false or null", *it);
    }
  }
  if (auto it = j.find("model_max_length"); it != j.end()) {
    if (!it->is_number()) return WrongType(path, "model_max_length", "a number", *it);
    const double v = it->get<double>();
    if (!(v >= 2) || (it->is_number_float() && v < std::numeric_limits<int>::max() &&
                      v != static_cast<int>(v))) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": \"model_max_length\" must be an integer >= 2, not ", it->dump()));
    }
    // Hugging Face writes 1e30 (VERY_LARGE_INTEGER) for "no limit".
    o->model_max_length = v >= std::numeric_limits<int>::max() ? std::numeric_limits<int>::max()
                                                               : static_cast<int>(v);
  }
  // Another tokenizer's ids would be valid ids and give plausible, wrong answers.
  if (auto it = j.find("tokenizer_class"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return WrongType(path, "tokenizer_class", "a string", *it);
    const std::string cls = it->get<std::string>();
    if (!BertTokenizer::IsSupportedClass(cls)) {
      return absl::UnimplementedError(absl::StrCat(
          path, ": tokenizer_class \"", Cut(cls),
          "\" is not supported; collabserve tokenizes as BertTokenizer / BertTokenizerFast do"));
    }
  }
  const std::pair<const char*, std::string*> tokens[] = {{"unk_token", &o->unk_token},
                                                         {"sep_token", &o->sep_token},
                                                         {"pad_token", &o->pad_token},
                                                         {"cls_token", &o->cls_token},
                                                         {"mask_token", &o->mask_token}};
  for (const auto& [key, out] : tokens) {
    auto it = j.find(key);
    if (it == j.end()) continue;
    if (it->is_null() && out == &o->mask_token) {
      out->clear();  // no mask token
    } else if (!TokenContent(*it, out)) {
      return WrongType(path, key, "a string or an object with a string \"content\"", *it);
    }
  }
  auto add_special = [o](const std::string& token) {
    auto& extra = o->additional_special_tokens;
    if (std::find(extra.begin(), extra.end(), token) == extra.end()) extra.push_back(token);
  };
  if (auto it = j.find("additional_special_tokens"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return WrongType(path, "additional_special_tokens", "a list", *it);
    for (const auto& e : *it) {
      std::string token;
      if (!TokenContent(e, &token)) {
        return WrongType(path, "additional_special_tokens",
                         "a list of strings or objects with a string \"content\"", e);
      }
      add_special(token);
    }
  }
  if (auto it = j.find("added_tokens_decoder"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) {
      return WrongType(path, "added_tokens_decoder", "an object {\"id\": token, ...}", *it);
    }
    for (const auto& [key, e] : it->items()) {
      DeclaredToken d{path, "", 0};
      if (!absl::SimpleAtoi(key, &d.id) || d.id < 0 || !TokenContent(e, &d.content)) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": added_tokens_decoder entry \"", Cut(key),
            "\" must map an id to a token with a string \"content\""));
      }
      auto special = e.is_object() ? e.find("special") : e.end();
      if (e.is_object() && special != e.end() && special->is_boolean() && special->get<bool>()) {
        add_special(d.content);
      }
      declared->push_back(std::move(d));
    }
  }
  return absl::OkStatus();
}

// added_tokens.json: {"token": id, ...}.
absl::Status ReadAddedTokens(const std::string& path, std::vector<DeclaredToken>* declared) {
  ASSIGN_OR_RETURN(std::string contents, util::ReadFile(path, kMaxConfigFileBytes));
  nlohmann::json j = nlohmann::json::parse(contents, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return util::JsonSyntaxError(contents, path);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object {\"token\": id}"));
  }
  for (const auto& [token, id] : j.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0) {
      return WrongType(path, token, "an id (an integer >= 0)", id);
    }
    declared->push_back({path, token, id.get<int64_t>()});
  }
  return absl::OkStatus();
}

// Every declared token must be a special token at its own vocab.txt id: a token added beyond
// vocab.txt would be split into word pieces here, and a non-special added token is matched in the
// text before WordPiece by Hugging Face, not here. Either way the ids, and the answers, would
// differ; refused instead.
absl::Status CheckDeclaredTokens(const BertTokenizer& tokenizer,
                                 const std::vector<DeclaredToken>& declared) {
  const TokenizerOptions& o = tokenizer.options();
  for (const DeclaredToken& d : declared) {
    if (d.id >= tokenizer.vocab_size() || tokenizer.IdToToken(static_cast<int32_t>(d.id)) != d.content) {
      return absl::UnimplementedError(absl::StrCat(
          d.file, ": added token \"", Cut(d.content), "\" has id ", d.id,
          d.id >= tokenizer.vocab_size()
              ? absl::StrCat(", beyond the ", tokenizer.vocab_size(), " tokens of vocab.txt")
              : absl::StrCat(", where vocab.txt has \"",
                             Cut(tokenizer.IdToToken(static_cast<int32_t>(d.id))), "\""),
          "; tokens added to the vocabulary are not supported"));
    }
    const bool special =
        d.content == o.unk_token || d.content == o.sep_token || d.content == o.pad_token ||
        d.content == o.cls_token || d.content == o.mask_token ||
        std::find(o.additional_special_tokens.begin(), o.additional_special_tokens.end(),
                  d.content) != o.additional_special_tokens.end();
    if (!special) {
      return absl::UnimplementedError(absl::StrCat(
          d.file, ": added token \"", Cut(d.content),
          "\" is not a special token; non-special added tokens (matched in the text before "
          "WordPiece) are not supported"));
    }
  }
  return absl::OkStatus();
}

// Per-thread scratch buffers keep their capacity between calls, except after an unusually large
// input, so that one huge request does not pin memory in every thread that ever served one.
template <typename T>
class ScratchGuard {
 public:
  explicit ScratchGuard(T* buffer) : buffer_(buffer) { buffer_->clear(); }
  ~ScratchGuard() {
    if (buffer_->capacity() > (size_t{1} << 16)) T().swap(*buffer_);
  }

 private:
  T* buffer_;
};

}  // namespace

BertTokenizer::BertTokenizer(std::vector<std::string> vocab, TokenizerOptions options,
                             int32_t unk_id)
    : vocab_(std::move(vocab)),
      options_(std::move(options)),
      wordpiece_(vocab_, unk_id),
      unk_id_(unk_id) {}

absl::StatusOr<std::unique_ptr<BertTokenizer>> BertTokenizer::Create(std::vector<std::string> vocab,
                                                                     TokenizerOptions options) {
  if (vocab.empty()) return absl::InvalidArgumentError("the vocabulary is empty");
  if (vocab.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("the vocabulary has ", vocab.size(), " tokens"));
  }
  if (options.model_max_length < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_max_length must be at least 2 (room for [CLS] and [SEP]), not ",
                     options.model_max_length));
  }
  for (const auto& [name, token] :
       {std::pair<const char*, const std::string*>{"unk_token", &options.unk_token},
        {"sep_token", &options.sep_token},
        {"pad_token", &options.pad_token},
        {"cls_token", &options.cls_token}}) {
    if (token->empty()) return absl::InvalidArgumentError(absl::StrCat(name, " is empty"));
  }
  // Later duplicates win, as in WordPiece.
  auto find = [&vocab](const std::string& token) -> int32_t {
    for (size_t i = vocab.size(); i-- > 0;) {
      if (vocab[i] == token) return static_cast<int32_t>(i);
    }
    return -1;
  };
  // Additional special tokens, less those that are one of the five.
  std::vector<std::pair<const std::string*, int32_t>> extra;
  for (const std::string& token : options.additional_special_tokens) {
    if (token.empty()) return absl::InvalidArgumentError("an additional special token is empty");
    if (token == options.unk_token || token == options.sep_token || token == options.pad_token ||
        token == options.cls_token || token == options.mask_token) {
      continue;
    }
    const int32_t id = find(token);
    if (id < 0) {
      return absl::UnimplementedError(absl::StrCat(
          "additional special token \"", Cut(token), "\" is not in the vocabulary (", vocab.size(),
          " tokens); tokens added to the vocabulary are not supported"));
    }
    extra.emplace_back(&token, id);
  }
  int32_t ids[5];
  const std::pair<const char*, const std::string*> specials[] = {
      {"unk_token", &options.unk_token},
      {"sep_token", &options.sep_token},
      {"pad_token", &options.pad_token},
      {"cls_token", &options.cls_token},
      {"mask_token", &options.mask_token}};
  for (int k = 0; k < 5; ++k) {
    const std::string& token = *specials[k].second;
    ids[k] = token.empty() ? -1 : find(token);
    if (!token.empty() && ids[k] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(specials[k].first, " \"", token,
                                                     "\" is not in the vocabulary (", vocab.size(),
                                                     " tokens)"));
    }
  }
  std::vector<std::pair<std::u32string, int32_t>> special_tokens;
  if (!options.split_special_tokens) {
    for (int k = 0; k < 5; ++k) {
      if (ids[k] < 0) continue;
      std::vector<char32_t> cps;
      RETURN_IF_ERROR(DecodeUtf8(*specials[k].second, &cps));
      special_tokens.emplace_back(std::u32string(cps.begin(), cps.end()), ids[k]);
    }
    for (const auto& [token, id] : extra) {
      std::vector<char32_t> cps;
      RETURN_IF_ERROR(DecodeUtf8(*token, &cps));
      special_tokens.emplace_back(std::u32string(cps.begin(), cps.end()), id);
    }
  }
  // Read before `options` moves into the tokenizer (`specials` and `extra` point into it).
  std::vector<uint8_t> id_flags(vocab.size(), 0);
  {
    std::unordered_map<std::string_view, size_t> last;  // a token's last line
    for (size_t i = 0; i < vocab.size(); ++i) last[vocab[i]] = i;
    std::vector<std::string_view> special_strings;
    for (int k = 0; k < 5; ++k) {
      if (ids[k] >= 0) special_strings.push_back(*specials[k].second);
    }
    for (const auto& [token, id] : extra) special_strings.push_back(*token);
    for (size_t i = 0; i < vocab.size(); ++i) {
      if (last[vocab[i]] != i) id_flags[i] |= kShadowedId;
      if (std::find(special_strings.begin(), special_strings.end(), vocab[i]) !=
          special_strings.end()) {
        id_flags[i] |= kSpecialId;
      }
    }
  }
  auto tokenizer = std::unique_ptr<BertTokenizer>(
      new BertTokenizer(std::move(vocab), std::move(options), ids[0]));
  tokenizer->sep_id_ = ids[1];
  tokenizer->pad_id_ = ids[2];
  tokenizer->cls_id_ = ids[3];
  tokenizer->mask_id_ = ids[4];
  tokenizer->special_tokens_ = std::move(special_tokens);
  tokenizer->id_flags_ = std::move(id_flags);
  return tokenizer;
}

namespace {

// Reads `vocab_path` and builds the tokenizer with `options`; errors name the vocabulary file.
absl::StatusOr<std::unique_ptr<BertTokenizer>> FromVocabFile(const std::string& vocab_path,
                                                              TokenizerOptions options) {
  ASSIGN_OR_RETURN(std::string contents, util::ReadFile(vocab_path, kMaxVocabFileBytes));
  ASSIGN_OR_RETURN(std::vector<std::string> vocab, ParseVocab(vocab_path, contents));
  auto tokenizer = BertTokenizer::Create(std::move(vocab), std::move(options));
  if (!tokenizer.ok()) {
    return util::Prefixed(tokenizer.status(), absl::StrCat(vocab_path, ": "));
  }
  return tokenizer;
}

}  // namespace

absl::StatusOr<std::unique_ptr<BertTokenizer>> BertTokenizer::FromFiles(
    const std::string& vocab_path, const std::string& tokenizer_config_path) {
  TokenizerOptions options;
  std::vector<DeclaredToken> declared;
  if (!tokenizer_config_path.empty()) {
    RETURN_IF_ERROR(ApplyConfig(tokenizer_config_path, &options, &declared));
  }
  ASSIGN_OR_RETURN(auto tokenizer, FromVocabFile(vocab_path, std::move(options)));
  RETURN_IF_ERROR(CheckDeclaredTokens(*tokenizer, declared));
  return tokenizer;
}

absl::StatusOr<std::unique_ptr<BertTokenizer>> BertTokenizer::FromDirectory(
    const std::string& dir) {
  TokenizerOptions options;
  std::vector<DeclaredToken> declared;
  for (const char* name : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const std::string path = util::JoinPath(dir, name);
    ASSIGN_OR_RETURN(bool present, util::PresentFile(path));
    if (present) RETURN_IF_ERROR(ApplyConfig(path, &options, &declared));
  }
  const std::string added_path = util::JoinPath(dir, "added_tokens.json");
  ASSIGN_OR_RETURN(bool added, util::PresentFile(added_path));
  if (added) RETURN_IF_ERROR(ReadAddedTokens(added_path, &declared));
  ASSIGN_OR_RETURN(auto tokenizer,
                   FromVocabFile(util::JoinPath(dir, "vocab.txt"), std::move(options)));
  RETURN_IF_ERROR(CheckDeclaredTokens(*tokenizer, declared));
  return tokenizer;
}

bool BertTokenizer::IsSupportedClass(std::string_view tokenizer_class) {
  return tokenizer_class == "BertTokenizer" || tokenizer_class == "BertTokenizerFast";
}

const std::string& BertTokenizer::IdToToken(int32_t id) const {
  static const std::string* const kEmpty = new std::string();
  if (id < 0 || static_cast<size_t>(id) >= vocab_.size()) return *kEmpty;
  return vocab_[id];
}

void BertTokenizer::AppendSegmentIds(const char32_t* begin, const char32_t* end,
                                     std::vector<int32_t>* ids, const uint32_t* bytes,
                                     std::vector<std::pair<int32_t, int32_t>>* offsets) const {
  if (begin == end) return;
  BertNormalizerOptions norm;
  norm.handle_chinese_chars = options_.tokenize_chinese_chars;
  norm.lowercase = options_.do_lower_case;
  norm.strip_accents = options_.strip_accents.value_or(options_.do_lower_case);
  // Scratch buffers, reused by every call on this thread.
  thread_local std::vector<char32_t> normalized;
  thread_local std::vector<WordSpan> words;
  thread_local std::string word, scratch;
  ScratchGuard g1(&normalized);
  ScratchGuard g2(&words);
  ScratchGuard g3(&word);
  ScratchGuard g4(&scratch);
  if (offsets == nullptr) {
    BertNormalize(begin, end, norm, &normalized);
    BertPreTokenize(normalized.data(), normalized.size(), &words);
    for (const auto& [b, e] : words) {
      word.clear();
      for (size_t i = b; i < e; ++i) AppendUtf8(normalized[i], &word);
      wordpiece_.Tokenize(word, e - b, ids, &scratch);
    }
    return;
  }
  // With offsets: each normalized code point's source, and each piece's end in its word, take a
  // piece back to the bytes of the code points it came from (first to last, as Hugging Face's
  // NormalizedString maps a normalized range back).
  std::vector<uint32_t> sources;
  BertNormalize(begin, end, norm, &normalized, &sources);
  BertPreTokenize(normalized.data(), normalized.size(), &words);
  std::vector<size_t> starts, ends;  // byte offset in `word` of each of its code points; piece ends
  for (const auto& [b, e] : words) {
    word.clear();
    starts.clear();
    for (size_t i = b; i < e; ++i) {
      starts.push_back(word.size());
      AppendUtf8(normalized[i], &word);
    }
    ends.clear();
    wordpiece_.Tokenize(word, e - b, ids, &scratch, &ends);
    size_t piece_start = 0;  // in bytes of `word`
    for (size_t piece_end : ends) {
      // The piece's code points [first, last) of the word (pieces are never empty).
      const size_t first =
          std::lower_bound(starts.begin(), starts.end(), piece_start) - starts.begin();
      const size_t last = std::lower_bound(starts.begin(), starts.end(), piece_end) - starts.begin();
      // Sources never decrease along the normalized text (NFD keeps each position's source).
      const uint32_t from = sources[b + first], to = sources[b + last - 1];
      offsets->emplace_back(static_cast<int32_t>(bytes[from]), static_cast<int32_t>(bytes[to + 1]));
      piece_start = piece_end;
    }
  }
}

absl::Status BertTokenizer::AppendIds(std::string_view text, std::string_view what,
                                      std::vector<int32_t>* ids,
                                      std::vector<std::pair<int32_t, int32_t>>* offsets) const {
  thread_local std::vector<char32_t> cps;
  ScratchGuard guard(&cps);
  absl::Status s = DecodeUtf8(text, &cps);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(AV(what), ": ", s.message()));
  const char32_t* data = cps.data();
  const size_t n = cps.size();
  // With offsets: the byte offset of each code point, and of the end.
  std::vector<uint32_t> bytes;
  if (offsets != nullptr) {
    bytes.reserve(n + 1);
    for (size_t b = 0; b < text.size(); ++b) {
      if ((static_cast<uint8_t>(text[b]) & 0xC0) != 0x80) bytes.push_back(static_cast<uint32_t>(b));
    }
    bytes.push_back(static_cast<uint32_t>(text.size()));
  }
  auto segment = [&](size_t from, size_t to) {
    AppendSegmentIds(data + from, data + to, ids, offsets != nullptr ? bytes.data() + from : nullptr,
                     offsets);
  };
  // Special tokens: leftmost match first, the longest at that position (Hugging Face's
  // AddedVocabulary uses Aho-Corasick with LeftmostLongest); the text between is tokenized
  // normally.
  size_t segment_start = 0, i = 0;
  while (i < n && !special_tokens_.empty()) {
    size_t best_len = 0;
    int32_t best_id = -1;
    for (const auto& [token, id] : special_tokens_) {
      if (token.size() > best_len && token.size() <= n - i && token[0] == data[i] &&
          std::equal(token.begin(), token.end(), data + i)) {
        best_len = token.size();
        best_id = id;
      }
    }
    if (best_len == 0) {
      ++i;
      continue;
    }
    segment(segment_start, i);
    ids->push_back(best_id);
    if (offsets != nullptr) {
      offsets->emplace_back(static_cast<int32_t>(bytes[i]),
                            static_cast<int32_t>(bytes[i + best_len]));
    }
    i += best_len;
    segment_start = i;
  }
  segment(segment_start, n);
  return absl::OkStatus();
}

absl::StatusOr<std::string> BertTokenizer::Decode(const std::vector<int32_t>& ids,
                                                 bool skip_special_tokens, size_t max_bytes) const {
  std::string out, piece;
  bool first = true;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || static_cast<size_t>(ids[i]) >= vocab_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("ids[", i, "] is ", ids[i],
                                                     ", not an id of this vocabulary (0 to ",
                                                     vocab_.size() - 1, ")"));
    }
    const std::string& token = vocab_[ids[i]];
    if (id_flags_[ids[i]] & kShadowedId) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ids[", i, "] is ", ids[i], ", whose token \"", Cut(token), "\" has the later id ",
          wordpiece_.TokenToId(token), " in this vocabulary: the tokenizer never gives ", ids[i]));
    }
    if (skip_special_tokens && (id_flags_[ids[i]] & kSpecialId)) continue;
    // tokenizers' decoders/wordpiece.rs: decode_chain, then cleanup on each token.
    if (first) {
      piece = token;
    } else if (token.compare(0, 2, "##") == 0) {
      piece = token.substr(2);
    } else {
      piece = " " + token;
    }
    first = false;
    for (const auto& [from, to] : {std::pair<std::string_view, std::string_view>{" .", "."},
                                   {" ?", "?"}, {" !", "!"}, {" ,", ","}, {" ' ", "'"},
                                   {" n't", "n't"}, {" 'm", "'m"}, {" do not", " don't"},
                                   {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}}) {
      for (size_t at = piece.find(from); at != std::string::npos; at = piece.find(from, at)) {
        piece.replace(at, from.size(), to);
        at += to.size();
      }
    }
    out += piece;
    if (out.size() > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("the text of ids[0, ", i + 1, ") is ",
                                                     out.size(), " bytes, over the limit of ",
                                                     max_bytes));
    }
  }
  return out;
}

absl::StatusOr<std::vector<int32_t>> BertTokenizer::TokenizeToIds(std::string_view text) const {
  std::vector<int32_t> ids;
  RETURN_IF_ERROR(AppendIds(text, "text", &ids));
  return ids;
}

absl::StatusOr<std::vector<std::string>> BertTokenizer::Tokenize(std::string_view text) const {
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenizeToIds(text));
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) tokens.push_back(vocab_[id]);
  return tokens;
}

absl::StatusOr<Encoding> BertTokenizer::Encode(std::string_view text,
                                               std::optional<std::string_view> text_pair,
                                               int max_length, bool truncate) const {
  EncodeOptions options;
  options.max_length = max_length;
  options.truncate = truncate;
  return Encode(text, text_pair, options);
}

absl::StatusOr<Encoding> BertTokenizer::Encode(std::string_view text,
                                               std::optional<std::string_view> text_pair,
                                               const EncodeOptions& options) const {
  using Offsets = std::vector<std::pair<int32_t, int32_t>>;
  std::vector<int32_t> a, b;
  Offsets a_offsets, b_offsets;
  RETURN_IF_ERROR(AppendIds(text, "text", &a, options.offsets ? &a_offsets : nullptr));
  if (text_pair) {
    RETURN_IF_ERROR(AppendIds(*text_pair, "text_pair", &b, options.offsets ? &b_offsets : nullptr));
  }
  const size_t limit = static_cast<size_t>(options.max_length > 0 ? options.max_length
                                                                  : options_.model_max_length);
  const size_t added = !options.add_special_tokens ? 0 : text_pair ? 3 : 2;
  if (limit < added) {
    return absl::InvalidArgumentError(absl::StrCat("max_length ", limit, " leaves no room for the ",
                                                   added, " special tokens of ",
                                                   text_pair ? "a text pair" : "a single text"));
  }
  Encoding enc;
  const size_t total = a.size() + b.size() + added;
  enc.num_tokens_before_truncation = static_cast<int>(total);
  if (total > limit) {
    if (!options.truncate) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the input is ", total, " tokens long",
          added > 0 ? " (special tokens included)" : "", ", over max_length ", limit,
          options.max_length > 0 ? "" : " (model_max_length)", ", and truncation is off"));
    }
    // tokenizers' truncate_encodings (utils/truncation.rs) with max_length - added special tokens.
    const size_t max = limit - added;
    size_t n1 = a.size(), n2 = b.size();
    if (!text_pair) {
      n1 = max;
    } else if (max == 0) {
      n1 = n2 = 0;
    } else {
      const bool swap = n1 > n2;
      if (swap) std::swap(n1, n2);
      n2 = n1 > max ? n1 : std::max(n1, max - n1);
      if (n1 + n2 > max) {
        n1 = max / 2;
        n2 = n1 + max % 2;
      }
      if (swap) std::swap(n1, n2);
    }
    if (n1 < a.size()) a.resize(n1);
    if (n2 < b.size()) b.resize(n2);
    if (options.offsets) {
      a_offsets.resize(a.size());
      b_offsets.resize(b.size());
    }
    enc.truncated = true;
  }
  // [CLS] a [SEP] (b [SEP]), or a (b) without the special tokens; each part's offsets and mask.
  auto add = [&](const std::vector<int32_t>& ids, const Offsets& offsets) {
    enc.input_ids.insert(enc.input_ids.end(), ids.begin(), ids.end());
    if (!options.offsets) return;
    enc.offsets.insert(enc.offsets.end(), offsets.begin(), offsets.end());
    enc.special_tokens_mask.resize(enc.input_ids.size(), 0);
  };
  auto special = [&](int32_t id) {
    if (!options.add_special_tokens) return;
    enc.input_ids.push_back(id);
    if (!options.offsets) return;
    enc.offsets.emplace_back(0, 0);
    enc.special_tokens_mask.push_back(1);
  };
  enc.input_ids.reserve(a.size() + b.size() + added);
  special(cls_id_);
  add(a, a_offsets);
  special(sep_id_);
  enc.token_type_ids.assign(enc.input_ids.size(), 0);
  if (text_pair) {
    add(b, b_offsets);
    special(sep_id_);
    enc.token_type_ids.resize(enc.input_ids.size(), 1);
  }
  return enc;
}

}  // namespace collabserve::text
