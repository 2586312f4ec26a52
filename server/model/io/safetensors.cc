#include "server/model/io/safetensors.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/model/io/checked_math.h"
#include "server/model/io/str_util.h"
#include "server/util/atomic_file_writer.h"
#include "server/util/status_macros.h"

namespace collabserve::model::io {
namespace {

using internal::Cat;

using internal::CheckedAdd;
using internal::CheckedMul;

struct HeaderEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint64_t> offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

// SAX handler that accepts exactly the safetensors header grammar and keeps only what it needs, so a
// hostile 100 MB header costs memory proportional to its useful content, never a DOM of it, and
// nesting deeper than the grammar allows stops the parse at once.
class HeaderSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderSax(std::string_view file) : file_(file) {}

  bool null() override { return TypeError("null"); }
  bool boolean(bool) override { return TypeError("a boolean"); }
  bool number_integer(number_integer_t v) override {
    if (depth_ == 3) {
      if (field_ == "shape") return Fail(Cat("shape has negative dim ", v));
      return Fail(Cat("data_offsets has negative offset ", v));
    }
    return TypeError("a number");
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (depth_ != 3) return TypeError("a number");
    if (field_ == "shape") {
      if (cur_.shape.size() >= kMaxTensorRank) {
        return Fail(Cat("shape has more than ", kMaxTensorRank, " dims"));
      }
      if (v > static_cast<uint64_t>(kMaxTensorDim)) {
        return Fail(Cat("shape dim ", v, " is over the limit of ", kMaxTensorDim));
      }
      cur_.shape.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (cur_.offsets.size() >= 2) return Fail("data_offsets must have exactly 2 numbers");
    cur_.offsets.push_back(v);
    return true;
  }
  bool number_float(number_float_t, const string_t& text) override {
    if (depth_ == 3) return Fail(Cat(field_, " has non-integer value ", text));
    return TypeError("a number");
  }
  bool string(string_t& s) override {
    if (depth_ == 2 && in_meta_) {
      meta_[key_] = s;
      return true;
    }
    if (depth_ == 2 && field_ == "dtype") {
      cur_.dtype = s;
      return true;
    }
    return TypeError("a string");
  }
  bool binary(binary_t&) override { return TypeError("binary"); }

  bool start_object(std::size_t) override {
    if (depth_ == 0) {
      depth_ = 1;
      return true;
    }
    if (depth_ == 1) {
      depth_ = 2;
      in_meta_ = name_ == "__metadata__";
      if (!in_meta_) {
        cur_ = HeaderEntry();
        cur_.name = name_;
      }
      return true;
    }
    return TypeError("an object");
  }
  bool key(string_t& k) override {
    if (depth_ == 1) {
      if (k.empty()) return Fail("tensor name is empty");
      if (!names_.insert(k).second) {
        name_ = k;
        return Fail("name appears twice in the header");
      }
      name_ = k;
      return true;
    }
    // depth_ == 2
    if (in_meta_) {
      key_ = k;
      return true;
    }
    field_ = k;
    bool* seen = nullptr;
    if (k == "dtype") seen = &cur_.has_dtype;
    if (k == "shape") seen = &cur_.has_shape;
    if (k == "data_offsets") seen = &cur_.has_offsets;
    if (seen == nullptr) return Fail(Cat("unknown field '", k, "'"));
    if (*seen) return Fail(Cat("field '", k, "' appears twice"));
    *seen = true;
    return true;
  }
  bool end_object() override {
    if (depth_ == 2) {
      depth_ = 1;
      if (in_meta_) {
        in_meta_ = false;
        return true;
      }
      field_.clear();
      if (!cur_.has_dtype) return Fail("missing field 'dtype'");
      if (!cur_.has_shape) return Fail("missing field 'shape'");
      if (!cur_.has_offsets) return Fail("missing field 'data_offsets'");
      if (cur_.offsets.size() != 2) return Fail("data_offsets must have exactly 2 numbers");
      entries_.push_back(std::move(cur_));
      return true;
    }
    depth_ = 0;
    return true;
  }
  bool start_array(std::size_t) override {
    if (depth_ == 2 && !in_meta_ && (field_ == "shape" || field_ == "data_offsets")) {
      depth_ = 3;
      return true;
    }
    return TypeError("an array");
  }
  bool end_array() override {
    depth_ = 2;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    error_ = absl::InvalidArgumentError(
        Cat(file_, ": header is not valid JSON (at byte ", position, "): ", ex.what()));
    return false;
  }

  const absl::Status& error() const { return error_; }
  std::vector<HeaderEntry>& entries() { return entries_; }
  std::map<std::string, std::string>& metadata() { return meta_; }

 private:
  bool Fail(std::string_view problem) {
    if (depth_ >= 2 && in_meta_) {
      error_ = absl::InvalidArgumentError(Cat(file_, ": __metadata__: ", problem));
    } else if (depth_ >= 1 && !name_.empty()) {
      error_ = absl::InvalidArgumentError(Cat(file_, ": tensor '", name_, "': ", problem));
    } else {
      error_ = absl::InvalidArgumentError(Cat(file_, ": header: ", problem));
    }
    return false;
  }
  bool TypeError(std::string_view got) {
    switch (depth_) {
      case 0:
        return Fail(Cat("header must be a JSON object, got ", got));
      case 1:
        if (name_ == "__metadata__") {
          error_ = absl::InvalidArgumentError(
              Cat(file_, ": __metadata__ must be an object, got ", got));
          return false;
        }
        return Fail(Cat("entry must be an object, got ", got));
      case 2:
        if (in_meta_) return Fail(Cat("value of '", key_, "' must be a string, got ", got));
        if (field_ == "dtype") return Fail(Cat("dtype must be a string, got ", got));
        return Fail(Cat(field_, " must be an array of integers, got ", got));
      default:
        return Fail(Cat(field_, " must contain only integers, got ", got));
    }
  }

  std::string file_;
  int depth_ = 0;
  bool in_meta_ = false;
  std::string name_, field_, key_;
  HeaderEntry cur_;
  std::set<std::string> names_;
  std::vector<HeaderEntry> entries_;
  std::map<std::string, std::string> meta_;
  absl::Status error_;
};

absl::Status Invalid(std::string_view file, std::string_view tensor, std::string_view problem) {
  return absl::InvalidArgumentError(Cat(file, ": tensor '", tensor, "': ", problem));
}

}  // namespace

absl::StatusOr<Checkpoint> ParseSafetensorsBytes(FileBytes bytes, std::string_view file) {
  if (bytes.size < 8) {
    return absl::InvalidArgumentError(Cat(
        file, ": not a safetensors file: ", bytes.size,
        " bytes is shorter than the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes.data[i];
  if (n > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(Cat(file, ": header length ", n,
                                                   " is over the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (n > bytes.size - 8) {
    return absl::InvalidArgumentError(Cat(file, ": header length ", n, " runs past the end of the ",
                                                   bytes.size, "-byte file (truncated?)"));
  }
  if (n < 2 || bytes.data[8] != '{') {
    return absl::InvalidArgumentError(
        Cat(file, ": header is not a JSON object (does not start with '{')"));
  }
  const char* header = reinterpret_cast<const char*>(bytes.data + 8);
  HeaderSax sax(file);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(header, header + n, &sax);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(Cat(file, ": header is not valid JSON: ", e.what()));
  }
  if (!ok) {
    if (!sax.error().ok()) return sax.error();
    return absl::InvalidArgumentError(Cat(file, ": header is not valid JSON"));
  }

  const uint8_t* buffer = bytes.data + 8 + n;
  const uint64_t buffer_size = bytes.size - 8 - n;
  Checkpoint out;
  out.metadata = std::move(sax.metadata());
  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (HeaderEntry& e : sax.entries()) {
    std::optional<DType> dtype = DTypeFromName(e.dtype);
    if (!dtype) {
      return Invalid(file, e.name, Cat("unknown or unsupported dtype '", e.dtype,
                                                "' (supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)"));
    }
    const uint64_t begin = e.offsets[0], end = e.offsets[1];
    if (begin > end) {
      return Invalid(file, e.name, Cat("data_offsets [", begin, ", ", end, ") has begin after end"));
    }
    if (end > buffer_size) {
      return Invalid(file, e.name,
                     Cat("data_offsets [", begin, ", ", end, ") run past the ", buffer_size,
                                  "-byte data buffer"));
    }
    uint64_t need = DTypeSize(*dtype);
    std::string shape_text;
    for (int64_t d : e.shape) {
      absl::StrAppend(&shape_text, shape_text.empty() ? "" : ", ", d);
      if (!CheckedMul(need, static_cast<uint64_t>(d), &need)) {
        return Invalid(file, e.name, Cat("shape [", shape_text, "...] overflows 64 bits"));
      }
    }
    if (end - begin != need) {
      return Invalid(file, e.name,
                     Cat("data_offsets [", begin, ", ", end, ") is ", end - begin,
                                  " bytes but ", e.dtype, " [", shape_text, "] needs ", need));
    }
    RawTensor t;
    t.dtype = *dtype;
    t.shape = e.shape;
    t.strides = ContiguousStrides(t.shape);
    t.owner = bytes.owner;
    t.data = buffer + begin;
    t.storage_bytes_available = end - begin;
    auto [it, inserted] = out.tensors.emplace(e.name, std::move(t));
    ranges.push_back({begin, end, &it->first});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const Range& a = ranges[i - 1];
    const Range& b = ranges[i];
    // Empty tensors own no bytes and cannot overlap anything.
    if (a.end > b.begin && a.begin != a.end && b.begin != b.end) {
      return Invalid(file, *b.name,
                     Cat("data_offsets [", b.begin, ", ", b.end, ") overlap tensor '",
                                  *a.name, "' at [", a.begin, ", ", a.end, ")"));
    }
  }
  return out;
}

absl::StatusOr<Checkpoint> ParseSafetensors(std::shared_ptr<const std::string> bytes,
                                            std::string_view name_for_errors) {
  if (bytes == nullptr) return absl::InvalidArgumentError(Cat(name_for_errors, ": no bytes"));
  return ParseSafetensorsBytes(BytesOfString(std::move(bytes)), name_for_errors);
}

absl::StatusOr<Checkpoint> ReadSafetensors(const std::string& path) {
  ASSIGN_OR_RETURN(FileBytes bytes, MapFileReadOnly(path));
  return ParseSafetensorsBytes(std::move(bytes), path);
}

namespace {

// What a safetensors file holds, in order: the 8-byte length and the header, then each tensor's
// bytes (views of the caller's data).
struct SafetensorsLayout {
  std::string prefix;
  std::vector<std::string_view> data;
  uint64_t total_bytes = 0;
};

absl::StatusOr<SafetensorsLayout> LayOutSafetensors(const std::vector<TensorToWrite>& tensors,
                                                    const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> order;
  std::set<std::string_view> names;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty()) return absl::InvalidArgumentError("WriteSafetensors: a tensor name is empty");
    if (t.name == "__metadata__") {
      return absl::InvalidArgumentError("WriteSafetensors: '__metadata__' is reserved");
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(Cat("WriteSafetensors: tensor '", t.name, "' appears twice"));
    }
    if (t.shape.size() > kMaxTensorRank) {
      return absl::InvalidArgumentError(Cat("WriteSafetensors: tensor '", t.name,
                                                     "' has more than ", kMaxTensorRank, " dims"));
    }
    uint64_t bytes = DTypeSize(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0 || d > kMaxTensorDim || !CheckedMul(bytes, static_cast<uint64_t>(d), &bytes)) {
        return absl::InvalidArgumentError(
            Cat("WriteSafetensors: tensor '", t.name, "' has invalid dim ", d));
      }
    }
    if (bytes > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(
          Cat("WriteSafetensors: tensor '", t.name, "' has no data"));
    }
    order.push_back(&t);
  }
  std::stable_sort(order.begin(), order.end(), [](const TensorToWrite* a, const TensorToWrite* b) {
    size_t sa = DTypeSize(a->dtype), sb = DTypeSize(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) {
    nlohmann::json meta = nlohmann::json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  SafetensorsLayout layout;
  uint64_t offset = 0;
  for (const TensorToWrite* t : order) {
    uint64_t bytes = DTypeSize(t->dtype);
    for (int64_t d : t->shape) bytes *= static_cast<uint64_t>(d);
    header[t->name] = {{"dtype", std::string(DTypeName(t->dtype))},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    if (bytes > 0) layout.data.emplace_back(static_cast<const char*>(t->data), bytes);
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const std::exception& e) {  // invalid UTF-8 in a name or a metadata string
    return absl::InvalidArgumentError(Cat("WriteSafetensors: ", e.what()));
  }
  while (header_text.size() % 8 != 0) header_text.push_back(' ');
  uint64_t n = header_text.size();
  for (int i = 0; i < 8; ++i) layout.prefix.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  layout.prefix += header_text;
  layout.total_bytes = layout.prefix.size() + offset;
  return layout;
}

}  // namespace

absl::StatusOr<std::string> SerializeSafetensors(const std::vector<TensorToWrite>& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(SafetensorsLayout layout, LayOutSafetensors(tensors, metadata));
  std::string out;
  out.reserve(layout.total_bytes);
  out += layout.prefix;
  for (std::string_view d : layout.data) out.append(d.data(), d.size());
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(SafetensorsLayout layout, LayOutSafetensors(tensors, metadata));
  ASSIGN_OR_RETURN(std::unique_ptr<util::AtomicFileWriter> file, util::AtomicFileWriter::Create(path));
  RETURN_IF_ERROR(file->Append(layout.prefix));
  for (std::string_view d : layout.data) RETURN_IF_ERROR(file->Append({d.data(), d.size()}));
  return file->Commit();
}

}  // namespace collabserve::model::io
