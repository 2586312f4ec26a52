// Fuzzes BertTokenizer with arbitrary bytes (valid and invalid UTF-8) and the real bert-base-uncased
// vocabulary. Input: byte 0 = flags (bit 0: encode a pair, bit 1: truncate, bits 2-3: which of four
// option sets, bit 4: the offsets check without special tokens), byte 1 = max_length (0: model_max_length), byte 2 = where to split the
// rest into text and text_pair (as a fraction of 255), then the text.
// Checks: Encode succeeds exactly when the text is well-formed UTF-8 (by an independent validator,
// the well-formed byte sequences of Unicode Table 3-7) and the length fits or truncation is on; the
// output has [CLS] ... [SEP] (... [SEP]), ids in range, token types that match, and never more than
// max_length ids when truncating; Tokenize and TokenizeToIds agree with Encode.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/text/bert_tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

#ifndef COLLABSERVE_SOURCE_DIR
#define COLLABSERVE_SOURCE_DIR "."
#endif

namespace {

using collabserve::text::BertTokenizer;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "TOKENIZER INVARIANT VIOLATED: %s\n", what);
  std::abort();
}

std::vector<std::unique_ptr<BertTokenizer>>* tokenizers = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("COLLABSERVE_SOURCE_DIR");
  const std::string vocab =
      std::string(dir ? dir : COLLABSERVE_SOURCE_DIR) + "/tests/data/bert-base-uncased-vocab.txt";
  auto base = BertTokenizer::FromFiles(vocab, "");
  if (!base.ok()) {
    std::fprintf(stderr, "cannot load %s: %s\n", vocab.c_str(),
                 std::string(base.status().message()).c_str());
    std::exit(1);
  }
  std::vector<std::string> words;
  for (int i = 0; i < (*base)->vocab_size(); ++i) words.push_back((*base)->IdToToken(i));
  tokenizers = new std::vector<std::unique_ptr<BertTokenizer>>();
  for (int variant = 0; variant < 4; ++variant) {
    collabserve::text::TokenizerOptions o;
    o.model_max_length = 64;
    if (variant == 1) o.do_lower_case = false;  // cased, accents kept
    if (variant == 2) { o.do_lower_case = false; o.strip_accents = true; o.tokenize_chinese_chars = false; }
    if (variant == 3) o.split_special_tokens = true;
    auto t = BertTokenizer::Create(words, o);
    if (!t.ok()) std::exit(1);
    tokenizers->push_back(*std::move(t));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const bool pair = data[0] & 1, truncate = data[0] & 2;
  const BertTokenizer& tok = *(*tokenizers)[(data[0] >> 2) & 3];
  const int max_length = data[1];
  // The text in an exactly-sized heap copy so that ASan sees any over-read.
  const size_t n = size - 3;
  std::unique_ptr<char[]> copy(new char[n == 0 ? 1 : n]);
  std::memcpy(copy.get(), data + 3, n);
  const std::string_view all(copy.get(), n);
  const size_t split = pair ? n * data[2] / 255 : n;
  const std::string_view a = all.substr(0, split), b = all.substr(split);

  const bool valid = collabserve::fuzz::ValidUtf8(a) && (!pair || collabserve::fuzz::ValidUtf8(b));
  auto enc = tok.Encode(a, pair ? std::optional<std::string_view>(b) : std::nullopt, max_length, truncate);
  auto ids_a = tok.TokenizeToIds(a);
  if (ids_a.ok() != collabserve::fuzz::ValidUtf8(a)) Fail("TokenizeToIds accepts exactly the well-formed UTF-8");
  if (auto tokens = tok.Tokenize(a); tokens.ok() != ids_a.ok() ||
                                     (tokens.ok() && tokens->size() != ids_a->size())) {
    Fail("Tokenize and TokenizeToIds disagree");
  }
  const size_t limit = max_length > 0 ? max_length : tok.options().model_max_length;
  const size_t added = pair ? 3 : 2;
  if (!valid || limit < added) {
    if (enc.ok()) Fail("Encode accepted invalid UTF-8 or a max_length without room for the specials");
    return 0;
  }
  std::vector<int32_t> ids_b;
  if (pair) ids_b = *tok.TokenizeToIds(b);
  const size_t total = ids_a->size() + ids_b.size() + added;
  if (!truncate && total > limit) {
    if (enc.ok()) Fail("Encode without truncation accepted an input over max_length");
    return 0;
  }
  if (!enc.ok()) Fail("Encode refused a well-formed input that fits");
  const auto& ids = enc->input_ids;
  if (enc->num_tokens_before_truncation != static_cast<int>(total)) Fail("num_tokens_before_truncation");
  if (ids.size() > limit) Fail("more ids than max_length");
  if (enc->truncated != (total > limit)) Fail("truncated flag");
  if (!enc->truncated && ids.size() != total) Fail("ids lost without truncation");
  if (enc->token_type_ids.size() != ids.size()) Fail("token_type_ids length");
  if (ids.front() != tok.cls_id() || ids.back() != tok.sep_id()) Fail("[CLS] ... [SEP] framing");
  for (int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) Fail("id out of range");
  }
  // Segment A is a prefix of TokenizeToIds(a), followed by [SEP]; B likewise with type 1.
  size_t pos = 1;
  for (; pos < ids.size() && enc->token_type_ids[pos] == 0; ++pos) {}
  const size_t len_a = (pair ? pos : ids.size()) - 2;
  if (len_a > ids_a->size() || !std::equal(ids.begin() + 1, ids.begin() + 1 + len_a, ids_a->begin())) {
    Fail("segment A is not a prefix of TokenizeToIds(text)");
  }
  if (ids[1 + len_a] != tok.sep_id()) Fail("[SEP] after segment A");
  if (pair) {
    const size_t len_b = ids.size() - pos - 1;
    if (len_b > ids_b.size() || !std::equal(ids.begin() + pos, ids.begin() + pos + len_b, ids_b.begin())) {
      Fail("segment B is not a prefix of TokenizeToIds(text_pair)");
    }
    for (size_t i = pos; i < ids.size(); ++i) {
      if (enc->token_type_ids[i] != 1) Fail("token type of segment B");
    }
  } else if (pos != ids.size()) {
    Fail("token type of a single text");
  }
  // The offsets path: the same ids, one span per id within its own text on code point
  // boundaries, (0, 0) and the mask for the [CLS]/[SEP] added; without the special tokens, the
  // word pieces alone.
  collabserve::text::EncodeOptions eo;
  eo.max_length = max_length;
  eo.truncate = truncate;
  eo.offsets = true;
  eo.add_special_tokens = !(data[0] & 16);
  auto spans = tok.Encode(a, pair ? std::optional<std::string_view>(b) : std::nullopt, eo);
  // Without the special tokens the word pieces fit wherever they fit with them.
  if (!spans.ok()) Fail("Encode with offsets refused what Encode took");
  if (eo.add_special_tokens && spans->input_ids != ids) Fail("offsets change the ids");
  if (!eo.add_special_tokens) {
    const size_t pieces = ids_a->size() + ids_b.size();
    if (spans->num_tokens_before_truncation != static_cast<int>(pieces)) {
      Fail("without special tokens: num_tokens_before_truncation");
    }
    if (spans->truncated != (pieces > limit) || spans->input_ids.size() > limit) {
      Fail("without special tokens: truncation");
    }
    // Each segment a prefix of its word pieces, in order (all of them when nothing was cut).
    size_t n_a = 0;
    while (n_a < spans->input_ids.size() && spans->token_type_ids[n_a] == 0) ++n_a;
    if (n_a > ids_a->size() ||
        !std::equal(spans->input_ids.begin(), spans->input_ids.begin() + n_a, ids_a->begin()) ||
        spans->input_ids.size() - n_a > ids_b.size() ||
        !std::equal(spans->input_ids.begin() + n_a, spans->input_ids.end(), ids_b.begin()) ||
        (!spans->truncated && spans->input_ids.size() != pieces)) {
      Fail("without special tokens: not the word pieces alone");
    }
  }
  if (spans->offsets.size() != spans->input_ids.size() ||
      spans->special_tokens_mask.size() != spans->input_ids.size() ||
      spans->token_type_ids.size() != spans->input_ids.size()) {
    Fail("one offset, mask entry and token type per id");
  }
  // Decode takes every id Encode gives, with and without the special tokens.
  if (!tok.Decode(spans->input_ids, true).ok() || !tok.Decode(spans->input_ids, false).ok()) {
    Fail("Decode refused ids Encode gave");
  }
  auto boundary = [](std::string_view t, int32_t at) {
    return at == static_cast<int32_t>(t.size()) || (static_cast<uint8_t>(t[at]) & 0xC0) != 0x80;
  };
  for (size_t i = 0; i < spans->input_ids.size(); ++i) {
    const auto [start, end] = spans->offsets[i];
    const bool added =
        eo.add_special_tokens &&
        (i == 0 || i + 1 == spans->input_ids.size() ||
         (pair && spans->token_type_ids[i] == 0 && spans->token_type_ids[i + 1] == 1));
    if (spans->special_tokens_mask[i] != (added ? 1 : 0)) Fail("special tokens mask");
    if (added) {
      if (start != 0 || end != 0) Fail("an added special token's span is not (0, 0)");
      continue;
    }
    const std::string_view own = spans->token_type_ids[i] == 0 ? a : b;
    if (start < 0 || start >= end || end > static_cast<int32_t>(own.size()) ||
        !boundary(own, start) || !boundary(own, end)) {
      Fail("a token's span is not a non-empty run of whole code points of its text");
    }
  }
  return 0;
}
