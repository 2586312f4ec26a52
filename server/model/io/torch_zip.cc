#include "server/model/io/torch_zip.h"

#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/model/io/checked_math.h"
#include "server/model/io/str_util.h"
#include "server/model/io/restricted_unpickler.h"
#include "server/model/io/zip_archive.h"
#include "server/util/atomic_file_writer.h"
#include "server/util/status_macros.h"

namespace collabserve::model::io {
namespace {

using internal::Cat;

using internal::CheckedMul;

absl::Status Invalid(std::string_view file, std::string_view problem) {
  return absl::InvalidArgumentError(Cat(file, ": ", problem));
}

// ---- pickle writing (protocol 2, the subset torch.save emits for a state dict) ----

class PickleWriter {
 public:
  void Proto() { out_ += "\x80\x02"; }
  void Global(std::string_view module, std::string_view name) {
    out_ += Cat("c", module, "\n", name, "\n");
  }
  void Str(std::string_view s) {
    out_.push_back('X');
    Le(s.size(), 4);
    out_ += s;
  }
  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      out_.push_back('K');
      Le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      out_.push_back('M');
      Le(static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_.push_back('J');
      Le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      out_ += "\x8a\x08";
      Le(static_cast<uint64_t>(v), 8);
    }
  }
  void IntTuple(const std::vector<int64_t>& v) {
    if (v.empty()) {
      out_.push_back(')');
      return;
    }
    Mark();
    for (int64_t x : v) Int(x);
    out_.push_back('t');
  }
  void Op(char c) { out_.push_back(c); }
  void Mark() { out_.push_back('('); }
  void EmptyOrderedDict() {
    Global("collections", "OrderedDict");
    out_ += ")R";
  }
  std::string Take() { return std::move(out_); }

 private:
  void Le(uint64_t v, int n) {
    for (int k = 0; k < n; ++k) out_.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
  }
  std::string out_;
};

absl::StatusOr<uint64_t> CheckTensorToWrite(const TensorToWrite& t, std::set<std::string_view>* names) {
  if (t.name.empty()) return absl::InvalidArgumentError("WriteTorchZip: a tensor name is empty");
  if (!internal::IsValidUtf8(t.name)) {
    return absl::InvalidArgumentError(
        Cat("WriteTorchZip: tensor name '", internal::Printable(t.name), "' is not valid UTF-8"));
  }
  if (!names->insert(t.name).second) {
    return absl::InvalidArgumentError(Cat("WriteTorchZip: tensor '", t.name, "' appears twice"));
  }
  if (t.shape.size() > kMaxTensorRank) {
    return absl::InvalidArgumentError(
        Cat("WriteTorchZip: tensor '", t.name, "' has more than ", kMaxTensorRank, " dims"));
  }
  uint64_t bytes = DTypeSize(t.dtype);
  for (int64_t d : t.shape) {
    if (d < 0 || d > kMaxTensorDim || !CheckedMul(bytes, static_cast<uint64_t>(d), &bytes)) {
      return absl::InvalidArgumentError(
          Cat("WriteTorchZip: tensor '", t.name, "' has invalid dim ", d));
    }
  }
  if (bytes > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(Cat("WriteTorchZip: tensor '", t.name, "' has no data"));
  }
  return bytes;
}

}  // namespace

absl::StatusOr<Checkpoint> ParseTorchZipBytes(FileBytes bytes, std::string_view file) {
  if (bytes.size == 0) return Invalid(file, "file is empty");
  if (LooksLikeLegacyTorchSave(bytes.data, bytes.size)) {
    return Invalid(file, "legacy (pre-1.6, non-zip) torch.save format is not supported; re-save it "
                         "with torch >= 1.6 or convert it to safetensors");
  }
  ASSIGN_OR_RETURN(ZipArchive zip, ZipArchive::Open(std::move(bytes), file));

  // The folder is whatever prefix data.pkl has (torch 1.x uses the file's stem, 2.x "archive").
  const ZipEntry* pkl = nullptr;
  std::string prefix;
  for (const ZipEntry& e : zip.entries()) {
    size_t slash = e.name.find('/');
    if (slash != std::string::npos && slash > 0 && e.name.substr(slash) == "/data.pkl") {
      if (pkl != nullptr) {
        return Invalid(file, Cat("two data.pkl entries ('", pkl->name, "' and '", e.name, "')"));
      }
      pkl = &e;
      prefix = e.name.substr(0, slash + 1);
    }
  }
  if (pkl == nullptr) {
    return Invalid(file, "zip has no <folder>/data.pkl entry: not a torch.save checkpoint");
  }
  const ZipEntry* version = zip.Find(prefix + "version");
  if (version == nullptr) version = zip.Find(prefix + ".data/version");
  if (version == nullptr) return Invalid(file, Cat("zip has no ", prefix, "version entry"));
  int version_number = 0;
  if (!absl::SimpleAtoi(std::string(internal::StripWhitespace(zip.Contents(*version))), &version_number) ||
      version_number < 1 || version_number > 20) {
    return Invalid(file, Cat("unsupported checkpoint format version '",
                                      internal::Printable(zip.Contents(*version).substr(0, 32)), "'"));
  }
  if (const ZipEntry* order = zip.Find(prefix + "byteorder"); order != nullptr) {
    std::string_view v = internal::StripWhitespace(zip.Contents(*order));
    if (v != "little") {
      return Invalid(file, Cat("byteorder is '", internal::Printable(v.substr(0, 32)),
                                        "'; only little-endian checkpoints are supported"));
    }
  }

  ASSIGN_OR_RETURN(std::unique_ptr<PickleResult> pickle,
                   UnpickleStateDict(zip.Contents(*pkl), Cat(file, ": data.pkl")));
  const PyValue* root = pickle->root;
  if (root->kind != PyKind::kDict) {
    return Invalid(file, Cat("data.pkl: the saved object is a ", PyKindName(root->kind),
                                      ", not a state dict"));
  }
  if (root->dict.size() == 1 && root->dict[0].first->kind == PyKind::kStr &&
      root->dict[0].second->kind == PyKind::kDict) {
    LOG(INFO) << file << ": reading the state dict nested under '" << root->dict[0].first->s << "'";
    root = root->dict[0].second;
  }

  Checkpoint out;
  const FileBytes& fb = zip.bytes();
  for (const auto& [key, value] : root->dict) {
    if (key->kind != PyKind::kStr) {
      return Invalid(file, Cat("data.pkl: a state dict key is a ", PyKindName(key->kind), ", not a str"));
    }
    if (key->s.empty()) return Invalid(file, "data.pkl: a tensor name is empty");
    if (value->kind != PyKind::kTensor) {
      return Invalid(file, Cat("tensor '", key->s, "': value is a ", PyKindName(value->kind),
                                        ", not a tensor"));
    }
    const PyValue* storage = value->storage;
    const ZipEntry* data = zip.Find(Cat(prefix, "data/", storage->s));
    if (data == nullptr) {
      return Invalid(file, Cat("tensor '", key->s, "': storage entry '", prefix, "data/",
                                        storage->s, "' is missing"));
    }
    const uint64_t esize = DTypeSize(storage->dtype);
    uint64_t storage_bytes;
    if (!CheckedMul(static_cast<uint64_t>(storage->numel), esize, &storage_bytes) || storage_bytes > data->size) {
      return Invalid(file, Cat("tensor '", key->s, "': storage '", storage->s, "' claims ",
                                        storage->numel, " ", DTypeName(storage->dtype), " elements but its entry has ",
                                        data->size, " bytes"));
    }
    RawTensor t;
    t.dtype = storage->dtype;
    t.shape = value->size;
    t.strides = value->stride;
    t.owner = fb.owner;
    const uint64_t offset_bytes = static_cast<uint64_t>(value->i) * esize;  // i <= numel: no overflow
    t.data = fb.data + data->data_offset + offset_bytes;
    t.storage_bytes_available = storage_bytes - offset_bytes;
    if (!out.tensors.emplace(key->s, std::move(t)).second) {
      return Invalid(file, Cat("tensor '", key->s, "' appears twice"));
    }
  }
  return out;
}

absl::StatusOr<Checkpoint> ParseTorchZip(std::shared_ptr<const std::string> bytes,
                                         std::string_view name_for_errors) {
  if (bytes == nullptr) return Invalid(name_for_errors, "no bytes");
  return ParseTorchZipBytes(BytesOfString(std::move(bytes)), name_for_errors);
}

absl::StatusOr<Checkpoint> ReadTorchZip(const std::string& path) {
  ASSIGN_OR_RETURN(FileBytes bytes, MapFileReadOnly(path));
  return ParseTorchZipBytes(std::move(bytes), path);
}

namespace {

// The archive's entries: data.pkl (held in `pickle`), then each tensor's bytes as a view of the
// caller's buffer.
absl::StatusOr<std::vector<ZipSource>> LayOutTorchZip(const std::vector<TensorToWrite>& tensors,
                                                      std::string* pickle_out) {
  std::set<std::string_view> names;
  std::vector<uint64_t> sizes;
  for (const TensorToWrite& t : tensors) {
    ASSIGN_OR_RETURN(uint64_t bytes, CheckTensorToWrite(t, &names));
    sizes.push_back(bytes);
  }
  PickleWriter w;
  w.Proto();
  w.EmptyOrderedDict();
  w.Mark();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& t = tensors[i];
    w.Str(t.name);
    w.Global("torch._utils", "_rebuild_tensor_v2");
    w.Mark();
    w.Mark();
    w.Str("storage");
    w.Global("torch", TorchStorageName(t.dtype));
    w.Str(Cat(i));
    w.Str("cpu");
    w.Int(static_cast<int64_t>(sizes[i] / DTypeSize(t.dtype)));
    w.Op('t');
    w.Op('Q');  // BINPERSID
    w.Int(0);
    w.IntTuple(t.shape);
    w.IntTuple(ContiguousStrides(t.shape));
    w.Op('\x89');  // requires_grad=False
    w.EmptyOrderedDict();  // backward_hooks
    w.Op('t');
    w.Op('R');
  }
  w.Op('u');
  // _metadata: every module prefix, in first-seen order, as nn.Module.state_dict records it.
  std::vector<std::string> prefixes;
  std::set<std::string> seen;
  auto add = [&](const std::string& p) {
    if (seen.insert(p).second) prefixes.push_back(p);
  };
  for (const TensorToWrite& t : tensors) {
    add("");
    for (size_t dot = t.name.find('.'); dot != std::string::npos; dot = t.name.find('.', dot + 1)) {
      add(t.name.substr(0, dot));
    }
  }
  w.Op('}');
  w.Str("_metadata");
  w.EmptyOrderedDict();
  w.Mark();
  for (const std::string& p : prefixes) {
    w.Str(p);
    w.Op('}');
    w.Str("version");
    w.Int(1);
    w.Op('s');
  }
  w.Op('u');
  w.Op('s');
  w.Op('b');  // BUILD: sets OrderedDict._metadata
  w.Op('.');
  *pickle_out = w.Take();

  std::vector<ZipSource> entries;
  entries.push_back({"archive/data.pkl", *pickle_out});
  entries.push_back({"archive/byteorder", "little"});
  for (size_t i = 0; i < tensors.size(); ++i) {
    entries.push_back({Cat("archive/data/", i),
                       std::string_view(static_cast<const char*>(tensors[i].data), sizes[i])});
  }
  entries.push_back({"archive/version", "3\n"});
  return entries;
}

}  // namespace

absl::StatusOr<std::string> SerializeTorchZip(const std::vector<TensorToWrite>& tensors, bool force_zip64) {
  std::string pickle;
  ASSIGN_OR_RETURN(std::vector<ZipSource> entries, LayOutTorchZip(tensors, &pickle));
  ZipWriteOptions options;
  options.force_zip64 = force_zip64;
  return BuildZip(entries, options);
}

absl::Status WriteTorchZip(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  std::string pickle;
  ASSIGN_OR_RETURN(std::vector<ZipSource> entries, LayOutTorchZip(tensors, &pickle));
  ASSIGN_OR_RETURN(std::unique_ptr<util::AtomicFileWriter> file, util::AtomicFileWriter::Create(path));
  RETURN_IF_ERROR(WriteZip(entries, ZipWriteOptions(), [&file](std::string_view bytes) {
    return file->Append({bytes.data(), bytes.size()});
  }));
  return file->Commit();
}

}  // namespace collabserve::model::io
