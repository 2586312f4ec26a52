// Fuzzes the tokenizer_config.json reader (BertTokenizer::FromFiles) with arbitrary file contents and
// a small vocabulary that has both BERT's and other special tokens, so that configs naming either
// succeed; a tokenizer that loads must then encode a text with literal special tokens in it.
// The input is written to a temporary file per process (FromFiles reads files).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

#include "server/text/bert_tokenizer.h"

namespace {

std::string* dir = nullptr;
std::string* vocab_path = nullptr;
std::string* config_path = nullptr;

void Cleanup() {
  std::remove(config_path->c_str());
  std::remove(vocab_path->c_str());
  ::rmdir(dir->c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/tokcfg_fuzz.XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    std::perror("mkdtemp");
    std::exit(1);
  }
  dir = new std::string(templ);
  vocab_path = new std::string(*dir + "/vocab.txt");
  config_path = new std::string(*dir + "/tokenizer_config.json");
  std::ofstream(*vocab_path) << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n<s>\n</s>\n<unk>\n<pad>\n"
                                "<mask>\nhello\nworld\n##s\nçà\n\xe4\xb8\xad\n[\n]\n<\n>\n/\n";
  std::atexit(Cleanup);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream f(*config_path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  auto tok = collabserve::text::BertTokenizer::FromFiles(*vocab_path, *config_path);
  if (!tok.ok()) {
    if (tok.status().message().empty()) std::abort();
    return 0;
  }
  const auto& o = (*tok)->options();
  if (o.model_max_length < 2) {
    std::fprintf(stderr, "accepted model_max_length %d\n", o.model_max_length);
    std::abort();
  }
  // A single text: model_max_length may be 2, too short for a pair's three special tokens.
  auto enc = (*tok)->Encode("Hello [SEP] worlds <s> ÇÀ 中 </s> [MASK]<mask>", std::nullopt, 0, true);
  if (!enc.ok() || enc->input_ids.empty() || enc->input_ids.front() != (*tok)->cls_id()) {
    std::fprintf(stderr, "a tokenizer that loaded cannot encode\n");
    std::abort();
  }
  return 0;
}
