#include "server/model/state_dict.h"

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/model/io/safetensors.h"
#include "server/model/io/torch_zip.h"
#include "server/util/files.h"

namespace collabserve::model {
namespace {

std::string ListSome(const std::vector<std::string>& names, size_t limit = 8) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(limit, names.size()));
  std::string s = absl::StrJoin(shown, ", ");
  if (names.size() > limit) absl::StrAppend(&s, " (and ", names.size() - limit, " more)");
  return s;
}

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Address ranges [start, end) of this process's read-only file mappings (/proc/self/maps: not
// writable, an inode), such as the checkpoint io::MapFileReadOnly maps. Empty where /proc is
// unreadable.
std::vector<std::pair<uintptr_t, uintptr_t>> ReadOnlyFileMappings() {
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms, offset, dev;
    unsigned long long inode = 0;
    if (!(in >> range >> perms >> offset >> dev >> inode)) continue;
    if (inode == 0 || perms.size() < 4 || perms[0] != 'r' || perms[1] != '-') continue;
    const size_t dash = range.find('-');
    if (dash == std::string::npos) continue;
    out.emplace_back(std::stoull(range.substr(0, dash), nullptr, 16),
                     std::stoull(range.substr(dash + 1), nullptr, 16));
  }
  return out;
}

// Drops this process's page-table entries for the whole pages of [data, data + n) once a tensor
// has been copied out of them, when the range lies inside a read-only file mapping: such pages come
// back from the page cache if read again (another tensor sharing a boundary page), so nothing is
// lost, and the checkpoint's pages stop counting in the server's resident memory while the rest
// of the model loads (for BERT-base the file is ~420 MiB next to the ~420 MiB of parameters it
// fills). Anything else (a checkpoint held in heap memory, where MADV_DONTNEED would zero the
// bytes) is left alone.
void ReleaseCopiedPages(const std::vector<std::pair<uintptr_t, uintptr_t>>& file_mappings,
                        const uint8_t* data, size_t n) {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + n;
  bool inside = false;
  for (const auto& [lo, hi] : file_mappings) {
    if (begin >= lo && end <= hi) {
      inside = true;
      break;
    }
  }
  if (!inside) return;
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// Whether none of n float32 values is infinite or NaN (all exponent bits set), without the
// temporaries of at::isfinite(t).all(): on BERT-base those were a bool tensor per parameter,
// ~100,000 page faults and 2.1 of the 4.4 s LoadStateDict took.
bool AllFinite(const float* p, int64_t n) {
  constexpr uint32_t kExponent = 0x7f800000u;
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    bad |= static_cast<uint32_t>((bits & kExponent) == kExponent);
  }
  return bad == 0;
}

}  // namespace

absl::StatusOr<at::Tensor> RawToFloatTensor(const io::RawTensor& raw, absl::string_view name) {
  at::ScalarType st;
  switch (raw.dtype) {
    case io::DType::kF32: st = at::kFloat; break;
    case io::DType::kF16: st = at::kHalf; break;
    case io::DType::kBF16: st = at::kBFloat16; break;
    case io::DType::kF64: st = at::kDouble; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has dtype ",
                                                     std::string(io::DTypeName(raw.dtype)),
                                                     "; a weight must be F32, F16, BF16 or F64"));
  }
  const int64_t numel = raw.numel();
  if (numel == 0) return at::empty(raw.shape, at::kFloat);
  // The bytes may be unaligned (a hostile or odd file): gather into an aligned contiguous buffer of
  // the source dtype first, then convert.
  at::Tensor src = at::empty(raw.shape, at::TensorOptions().dtype(st));
  const size_t esize = io::DTypeSize(raw.dtype);
  uint8_t* dst = static_cast<uint8_t*>(src.data_ptr());
  if (raw.is_contiguous()) {
    std::memcpy(dst, raw.data, static_cast<size_t>(numel) * esize);
  } else {
    const size_t ndim = raw.shape.size();
    std::vector<int64_t> idx(ndim, 0);
    for (int64_t n = 0; n < numel; ++n) {
      int64_t off = 0;
      for (size_t d = 0; d < ndim; ++d) off += idx[d] * raw.strides[d];
      std::memcpy(dst + n * esize, raw.data + off * esize, esize);
      for (size_t d = ndim; d-- > 0;) {
        if (++idx[d] < raw.shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  return st == at::kFloat ? src : src.to(at::kFloat);
}

std::string NormalizeKey(absl::string_view key) {
  std::string k(key);
  if (absl::StartsWith(k, "embeddings.") || absl::StartsWith(k, "encoder.") ||
      absl::StartsWith(k, "pooler.")) {
    k = "bert." + k;
  }
  if (absl::EndsWith(k, "LayerNorm.gamma")) k = k.substr(0, k.size() - 5) + "weight";
  if (absl::EndsWith(k, "LayerNorm.beta")) k = k.substr(0, k.size() - 4) + "bias";
  return k;
}

absl::Status LoadStateDict(BertClassifier& model, const io::Checkpoint& checkpoint,
                           absl::string_view file, bool borrow_packed) {
  std::map<std::string, const io::RawTensor*> by_key;
  std::map<std::string, std::string> source_key;  // normalized key -> the checkpoint's own
  std::vector<std::string> unexpected;
  for (const auto& [key, raw] : checkpoint.tensors) {
    std::string k = NormalizeKey(key);
    if (absl::EndsWith(k, "position_ids") || absl::StartsWith(k, "cls.")) continue;
    // Two spellings of one parameter ("bert.x" and "x", gamma and weight): which one to load is a
    // guess, and a wrong guess loads silently.
    if (auto [it, fresh] = source_key.emplace(k, key); !fresh) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": tensors '", it->second, "' and '", key,
                                                     "' are both parameter '", k,
                                                     "'; keep one of them"));
    }
    by_key[k] = &raw;
  }
  const std::vector<std::pair<uintptr_t, uintptr_t>> file_mappings = ReadOnlyFileMappings();
  auto params = model.named_parameters(/*recurse=*/true);
  std::set<std::string> known;
  std::vector<std::string> missing, misshaped;
  for (auto& item : params) {
    known.insert(item.key());
    auto it = by_key.find(item.key());
    if (it == by_key.end()) {
      missing.push_back(item.key());
      continue;
    }
    const io::RawTensor& raw = *it->second;
    at::Tensor& p = item.value();
    if (at::IntArrayRef(raw.shape) != p.sizes()) {
      misshaped.push_back(absl::StrCat(item.key(), " is ", ShapeString(raw.shape), ", expected ",
                                       ShapeString(p.sizes())));
      continue;
    }
    at::NoGradGuard no_grad;
    const bool f32_in_place = raw.dtype == io::DType::kF32 && raw.is_contiguous() && p.is_contiguous() &&
                              p.is_cpu() && p.scalar_type() == at::kFloat;
    const bool borrow = borrow_packed && f32_in_place &&
                        reinterpret_cast<uintptr_t>(raw.data) % alignof(float) == 0 && model.PackedOnPrepare(p);
    if (borrow) {
      // A view of the checkpoint's bytes, which holds them (and their mapping) until Prepare has
      // packed it and drops it; the parameter's own pages are never touched.
      c10::InferenceMode normal_tensors(false);  // set_data takes no inference tensor
      std::shared_ptr<const void> owner = raw.owner;
      p.set_data(at::from_blob(const_cast<uint8_t*>(raw.data), p.sizes(), [owner](void*) {},
                               at::TensorOptions().dtype(at::kFloat)));
    } else if (f32_in_place) {
      // The common case (float32 safetensors): straight into the parameter, no temporary copy.
      if (raw.nbytes() > 0) std::memcpy(p.data_ptr(), raw.data, raw.nbytes());
    } else {
      auto t = RawToFloatTensor(raw, item.key());
      if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(file, ": ", t.status().message()));
      p.copy_(*t);
    }
    if (!AllFinite(p.data_ptr<float>(), p.numel())) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": tensor '", item.key(), "' has non-finite values (NaN or Inf)"));
    }
    if (!borrow && raw.is_contiguous()) ReleaseCopiedPages(file_mappings, raw.data, raw.nbytes());
  }
  for (const auto& [k, raw] : by_key) {
    if (!known.count(k)) unexpected.push_back(k);
  }
  std::vector<std::string> problems;
  if (!missing.empty()) problems.push_back(absl::StrCat("missing tensors: ", ListSome(missing)));
  if (!misshaped.empty()) problems.push_back(absl::StrCat("wrong shapes: ", ListSome(misshaped)));
  if (!unexpected.empty()) {
    problems.push_back(absl::StrCat("unexpected tensors: ", ListSome(unexpected)));
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", absl::StrJoin(problems, "; ")));
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, at::Tensor>> NamedWeights(const BertClassifier& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

absl::Status SaveWeights(const BertClassifier& model, const std::string& dir, WeightFormat format,
                         WeightDType dtype, const std::map<std::string, std::string>& metadata) {
  at::ScalarType st = dtype == WeightDType::kF16    ? at::kHalf
                      : dtype == WeightDType::kBF16 ? at::kBFloat16
                                                    : at::kFloat;
  io::DType io_dtype = dtype == WeightDType::kF16    ? io::DType::kF16
                       : dtype == WeightDType::kBF16 ? io::DType::kBF16
                                                     : io::DType::kF32;
  if (model.weights_released()) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": the model was prepared for serving and keeps its dense weights only in "
                          "packed form; load it with pack_weights = false to save it"));
  }
  std::vector<at::Tensor> keep;
  std::vector<io::TensorToWrite> tensors;
  for (auto& [name, t] : NamedWeights(model)) {
    at::Tensor c = t.to(at::kCPU).to(st).contiguous();
    keep.push_back(c);
    tensors.push_back(io::TensorToWrite{name, io_dtype, c.sizes().vec(), c.data_ptr()});
  }
  if (format == WeightFormat::kSafetensors) {
    return io::WriteSafetensors(util::JoinPath(dir, "model.safetensors"), tensors, metadata);
  }
  return io::WriteTorchZip(util::JoinPath(dir, "pytorch_model.bin"), tensors);
}

}  // namespace collabserve::model
