// Parity with Hugging Face tokenizers: the corpora in tests/reference/tokenizer_corpus*.jsonl and
// every Unicode scalar value are run through tests/reference/hf_tokenize.js (the Rust crate through
// its Node binding) and through BertTokenizer: the ids, each token's span, and the text decoded
// from the ids must be identical. Without node or the
// npm module this test fails: parity is a release criterion, not an optional extra.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/text/bert_normalizer.h"
#include "server/text/bert_pre_tokenizer.h"
#include "server/text/bert_tokenizer.h"
#include "server/text/unicode.h"
#include "server/text/utf8.h"

namespace collabserve::text {
namespace {

std::string SourceDir() {
  const char* dir = std::getenv("COLLABSERVE_SOURCE_DIR");
  return dir ? dir : ".";
}
std::string ReferenceDir() { return SourceDir() + "/tests/reference"; }
std::string VocabPath() { return SourceDir() + "/tests/data/bert-base-uncased-vocab.txt"; }
// Hand-written cases, and random strings that stress NFD ordering, rare code points and truncation.
const char* const kCorpora[] = {"tokenizer_corpus.jsonl", "tokenizer_corpus_random.jsonl"};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> Lines(const std::string& s) {
  std::vector<std::string> lines;
  std::stringstream ss(s);
  for (std::string line; std::getline(ss, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

// Runs `node hf_tokenize.js args < stdin_path`; returns its stdout, or fails the test with stderr.
bool RunReference(const std::string& args, const std::string& stdin_path, std::string* out) {
  if (std::system("command -v node >/dev/null 2>&1") != 0) {
    ADD_FAILURE() << "node is not on PATH: the tokenizer parity test needs Node.js 18+ and "
                     "`npm ci` in tests/reference (scripts/install-deps.sh installs both)";
    return false;
  }
  const std::string err_path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") +
                               "/collabserve_parity_" + std::to_string(::getpid()) + ".err";
  const std::string cmd = "node '" + ReferenceDir() + "/hf_tokenize.js' " + args + " < '" +
                          stdin_path + "' 2> '" + err_path + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    ADD_FAILURE() << "cannot run: " << cmd;
    return false;
  }
  out->clear();
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out->append(buf, n);
  const int status = ::pclose(p);
  const std::string err = ReadAll(err_path);
  std::remove(err_path.c_str());
  if (status != 0) {
    ADD_FAILURE()
        << "the reference failed (exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1)
        << "): " << cmd << "\n"
        << err
        << (WIFEXITED(status) && WEXITSTATUS(status) == 3
                ? "\nInstall it: (cd tests/reference && npm ci), or scripts/install-deps.sh"
                : "");
    return false;
  }
  return true;
}

struct Config {
  const char* name;
  const char* args;
  bool lowercase;
  std::optional<bool> strip_accents;
  bool split_special_tokens;
};

std::string Normalized(const TokenizerOptions& o, const std::string& text) {
  std::vector<char32_t> cps, out;
  EXPECT_TRUE(DecodeUtf8(text, &cps).ok());
  BertNormalizerOptions n;
  n.lowercase = o.do_lower_case;
  n.strip_accents = o.strip_accents.value_or(o.do_lower_case);
  n.handle_chinese_chars = o.tokenize_chinese_chars;
  BertNormalize(cps.data(), cps.data() + cps.size(), n, &out);
  std::string s;
  for (char32_t c : out) AppendUtf8(c, &s);
  return s;
}

void CheckCorpus(const Config& c, const BertTokenizer& tokenizer, const std::string& path) {
  std::string ref_out;
  ASSERT_TRUE(RunReference(std::string("--vocab '") + VocabPath() + "' " + c.args, path, &ref_out));
  const std::vector<std::string> inputs = Lines(ReadAll(path));
  const std::vector<std::string> expected = Lines(ref_out);
  ASSERT_GE(inputs.size(), 300u) << path;
  ASSERT_EQ(inputs.size(), expected.size()) << "the reference answered a different number of lines";

  int identical = 0, refused = 0, differing = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const nlohmann::json in = nlohmann::json::parse(inputs[i]);
    const nlohmann::json want = nlohmann::json::parse(expected[i]);
    ASSERT_FALSE(want.contains("error")) << "line " << i + 1 << ": " << want.dump();
    const std::string text = in["text"].get<std::string>();
    std::optional<std::string> pair;
    if (in.contains("text_pair")) pair = in["text_pair"].get<std::string>();
    const int max_length =
        in.contains("max_length") ? in["max_length"].get<int>() : std::numeric_limits<int>::max();
    auto got = tokenizer.Encode(text, pair ? std::optional<std::string_view>(*pair) : std::nullopt,
                                max_length);
    if (max_length < (pair ? 3 : 2)) {
      // Hugging Face subtracts the special tokens from max_length in unsigned arithmetic and wraps
      // around to "no limit"; collabserve refuses such a max_length instead.
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << "line " << i + 1;
      ++refused;
      continue;
    }
    ASSERT_TRUE(got.ok()) << "line " << i + 1 << ": " << got.status();
    const auto want_ids = want["ids"].get<std::vector<int32_t>>();
    const auto want_types = want["type_ids"].get<std::vector<int32_t>>();
    // The normalizer on each whole text, where ids alone could hide a difference (canonical order
    // of marks the vocabulary does not have, for instance).
    std::vector<std::string> normalized = {Normalized(tokenizer.options(), text)};
    if (pair) normalized.push_back(Normalized(tokenizer.options(), *pair));
    if (normalized != want["normalized"].get<std::vector<std::string>>()) {
      ++differing;
      ADD_FAILURE() << c.name << " line " << i + 1 << ": " << inputs[i]
                    << "\n  reference normalized: " << want["normalized"].dump()
                    << "\n  ours:                 " << nlohmann::json(normalized).dump();
    } else if (got->input_ids == want_ids && got->token_type_ids == want_types) {
      // The offsets path tokenizes the same and gives Hugging Face's spans: ours are bytes of the
      // token's own text, the binding's code points.
      EncodeOptions eo;
      eo.max_length = max_length;
      eo.offsets = true;
      auto spans = tokenizer.Encode(text, pair ? std::optional<std::string_view>(*pair) : std::nullopt, eo);
      ASSERT_TRUE(spans.ok()) << spans.status();
      EXPECT_EQ(spans->input_ids, want_ids) << "line " << i + 1;
      std::vector<std::pair<int32_t, int32_t>> chars;
      for (size_t t = 0; t < spans->offsets.size(); ++t) {
        const std::string& own = spans->token_type_ids[t] == 0 ? text : *pair;
        auto to_chars = [&own](int32_t byte) {
          return static_cast<int32_t>(std::count_if(own.begin(), own.begin() + byte, [](char ch) {
            return (static_cast<uint8_t>(ch) & 0xC0) != 0x80;
          }));
        };
        chars.emplace_back(to_chars(spans->offsets[t].first), to_chars(spans->offsets[t].second));
      }
      const auto want_offsets = want["offsets"].get<std::vector<std::pair<int32_t, int32_t>>>();
      const auto want_special = want["special"].get<std::vector<uint8_t>>();
      // Decode, without and with the special tokens.
      const auto decoded = tokenizer.Decode(want_ids, /*skip_special_tokens=*/true);
      const auto decoded_all = tokenizer.Decode(want_ids, /*skip_special_tokens=*/false);
      ASSERT_TRUE(decoded.ok() && decoded_all.ok()) << decoded.status() << decoded_all.status();
      EXPECT_EQ(*decoded, want["decoded"].get<std::string>()) << c.name << " line " << i + 1;
      EXPECT_EQ(*decoded_all, want["decoded_all"].get<std::string>()) << c.name << " line " << i + 1;
      if (chars == want_offsets && spans->special_tokens_mask == want_special) {
        ++identical;
      } else {
        ++differing;
        ADD_FAILURE() << c.name << " line " << i + 1 << ": " << inputs[i]
                      << "\n  reference offsets: " << want["offsets"].dump() << " special "
                      << want["special"].dump() << "\n  ours (chars):      "
                      << nlohmann::json(chars).dump() << " special "
                      << nlohmann::json(spans->special_tokens_mask).dump();
      }
    } else {
      ++differing;
      ADD_FAILURE()
          << c.name << " line " << i + 1 << ": " << inputs[i] << "\n  reference: " << want.dump()
          << "\n  ours:      "
          << nlohmann::json({{"ids", got->input_ids}, {"type_ids", got->token_type_ids}}).dump();
    }
  }
  std::printf(
      "[%s] %s: %d of %zu lines identical to Hugging Face tokenizers, %d differ, %d refused "
      "(max_length below the special tokens)\n",
      c.name, path.substr(path.rfind('/') + 1).c_str(), identical, inputs.size(), differing,
      refused);
}

class CorpusParityTest : public ::testing::TestWithParam<Config> {};

TEST_P(CorpusParityTest, IdsEqualHuggingFaceOnEveryLine) {
  const Config& c = GetParam();
  TokenizerOptions o;
  o.do_lower_case = c.lowercase;
  o.strip_accents = c.strip_accents;
  o.split_special_tokens = c.split_special_tokens;
  auto base = BertTokenizer::FromFiles(VocabPath(), "");
  ASSERT_TRUE(base.ok()) << base.status();
  std::vector<std::string> vocab;
  for (int i = 0; i < (*base)->vocab_size(); ++i) vocab.push_back((*base)->IdToToken(i));
  auto tokenizer = BertTokenizer::Create(vocab, o);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();

  for (const char* corpus : kCorpora) {
    SCOPED_TRACE(corpus);
    CheckCorpus(c, **tokenizer, ReferenceDir() + "/" + corpus);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, CorpusParityTest,
    ::testing::Values(
        Config{"uncased", "", true, std::nullopt, false},
        Config{"cased", "--lowercase 0", false, std::nullopt, false},
        Config{"lowercase_keep_accents", "--lowercase 1 --strip-accents 0", true, false, false},
        Config{"cased_strip_accents", "--lowercase 0 --strip-accents 1", false, true, false},
        Config{"split_special_tokens", "--split-special-tokens", true, std::nullopt, true}),
    [](const ::testing::TestParamInfo<Config>& info) { return std::string(info.param.name); });

std::string Hex(const std::vector<char32_t>& cps) {
  std::string s;
  char buf[16];
  for (size_t i = 0; i < cps.size(); ++i) {
    std::snprintf(buf, sizeof buf, i ? " %X" : "%X", static_cast<unsigned>(cps[i]));
    s += buf;
  }
  return s;
}

// Our version of one line of `hf_tokenize.js --probe` (see there), or "" for the default behaviour.
std::string ProbeLine(char32_t c) {
  std::vector<WordSpan> words;
  const char32_t abc[3] = {U'a', c, U'b'};
  BertPreTokenize(abc, 3, &words);
  const char cls = words.size() == 2 ? 'w' : words.size() == 3 ? 'p' : '-';
  std::string fields;
  bool non_default = cls != '-';
  for (auto [lc, sa] : {std::pair{true, true}, {true, false}, {false, true}, {false, false}}) {
    BertNormalizerOptions o;
    o.lowercase = lc;
    o.strip_accents = sa;
    std::vector<char32_t> out;
    BertNormalize(&c, &c + 1, o, &out);
    const bool same = out.size() == 1 && out[0] == c;
    non_default |= !same;
    fields += '\t';
    fields += same ? std::string("=") : Hex(out);
  }
  std::vector<char32_t> nfd;
  unicode::AppendDecomposition(c, &nfd);
  nfd.push_back(0x334);
  unicode::CanonicalOrder(nfd.data(), nfd.data() + nfd.size());
  const bool reordered = nfd[0] == 0x334;
  non_default |= reordered;
  if (!non_default) return "";
  char head[16];
  std::snprintf(head, sizeof head, "%X\t%c", static_cast<unsigned>(c), cls);
  return head + fields + "\t" + (reordered ? "r" : "-");
}

TEST(UnicodeParityTest, EveryScalarValueBehavesAsInHuggingFace) {
  std::string ref_out;
  ASSERT_TRUE(RunReference("--probe", "/dev/null", &ref_out));
  std::vector<std::string> ref_lines = Lines(ref_out);
  ASSERT_GT(ref_lines.size(), 100000u);
  size_t next = 0, differing = 0, checked = 0;
  for (char32_t c = 0; c <= 0x10FFFF; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    ++checked;
    char prefix[16];
    const int n = std::snprintf(prefix, sizeof prefix, "%X\t", static_cast<unsigned>(c));
    std::string want;
    if (next < ref_lines.size() && ref_lines[next].compare(0, n, prefix) == 0)
      want = ref_lines[next++];
    const std::string got = ProbeLine(c);
    if (got != want && ++differing <= 30) {
      ADD_FAILURE() << "U+" << prefix << " reference: [" << want << "] ours: [" << got << "]";
    }
  }
  EXPECT_EQ(next, ref_lines.size()) << "reference lines left unmatched";
  EXPECT_EQ(differing, 0u);
  std::printf("%zu scalar values checked, %zu differ from Hugging Face tokenizers\n", checked,
              differing);
}

}  // namespace
}  // namespace collabserve::text
