// Fuzzes the torch.save reader: the zip reader, the restricted unpickler and the state-dict checks,
// all through ParseTorchZipBytes. An input starting with 'P' is taken as a whole file (a zip, as
// torch.save writes: "PK\3\4"); anything else is taken as the data.pkl of an otherwise valid archive
// (with version, byteorder and storages archive/data/0..15 of 256 bytes each), so that mutations of the
// pickle are not all stopped by the zip's CRC-32 checks. Seeds: tests/fuzz/corpus/torch_zip/ has
// both (*.bin whole files, *.pkl pickles).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/model/io/torch_zip.h"
#include "server/model/io/zip_archive.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr int kStorages = 16;
constexpr size_t kStorageBytes = 256;

std::string WrapPickle(const uint8_t* data, size_t size) {
  using collabserve::model::io::ZipSource;
  static const std::string* const storage = [] {
    auto* s = new std::string(kStorageBytes, '\0');
    for (size_t i = 0; i < s->size(); ++i) (*s)[i] = static_cast<char>(i * 37 + 11);
    return s;
  }();
  static const std::vector<std::string>* const names = [] {
    auto* v = new std::vector<std::string>();
    for (int i = 0; i < kStorages; ++i) v->push_back(absl::StrCat("archive/data/", i));
    return v;
  }();
  std::vector<ZipSource> entries;
  entries.push_back({"archive/data.pkl", std::string_view(reinterpret_cast<const char*>(data), size)});
  entries.push_back({"archive/byteorder", "little"});
  for (const std::string& name : *names) entries.push_back({name, *storage});
  entries.push_back({"archive/version", "3\n"});
  auto zip = collabserve::model::io::BuildZip(entries);
  if (!zip.ok()) std::abort();  // the names are fixed and valid
  return *std::move(zip);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  FLAGS_minloglevel = 2;  // the reader logs when it unwraps a nested state dict
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace collabserve;
  model::io::FileBytes bytes;
  if (size > 0 && data[0] == 'P') {
    bytes = fuzz::ExactCopy(data, size);
  } else {
    const std::string zip = WrapPickle(data, size);
    bytes = fuzz::ExactCopy(reinterpret_cast<const uint8_t*>(zip.data()), zip.size());
  }
  const uint8_t* file = bytes.data;
  const size_t file_size = bytes.size;
  auto checkpoint = model::io::ParseTorchZipBytes(bytes, "fuzz.bin");
  if (!checkpoint.ok()) {
    if (checkpoint.status().message().empty()) std::abort();
    return 0;
  }
  for (const auto& [name, tensor] : checkpoint->tensors) {
    if (name.empty()) fuzz::Violation("empty name accepted", name);
    fuzz::CheckTensorInBounds(name, tensor, file, file_size);
  }
  // Round trip through the writer, which refuses names that are not valid UTF-8 (the pickle's
  // strings are bytes we do not validate), so only checkpoints whose names are valid.
  std::vector<std::string> storage;
  storage.reserve(checkpoint->tensors.size());
  std::vector<model::io::TensorToWrite> tensors;
  for (const auto& [name, tensor] : checkpoint->tensors) {
    if (!fuzz::ValidUtf8(name)) return 0;
    storage.push_back(fuzz::ContiguousBytes(tensor));
    tensors.push_back({name, tensor.dtype, tensor.shape, storage.back().data()});
  }
  auto written = model::io::SerializeTorchZip(tensors);
  if (!written.ok()) {
    std::fprintf(stderr, "cannot write what was read: %s\n", std::string(written.status().message()).c_str());
    std::abort();
  }
  auto again = model::io::ParseTorchZip(std::make_shared<const std::string>(*std::move(written)), "again");
  if (!again.ok()) {
    std::fprintf(stderr, "cannot read what was written: %s\n", std::string(again.status().message()).c_str());
    std::abort();
  }
  fuzz::CheckSameTensors(*checkpoint, *again);
  return 0;
}
