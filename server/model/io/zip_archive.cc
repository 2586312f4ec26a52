#include "server/model/io/zip_archive.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/model/io/checked_math.h"
#include "server/model/io/str_util.h"
#include "server/util/status_macros.h"

namespace collabserve::model::io {
namespace {

using internal::Cat;

using internal::CheckedAdd;

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kDescriptorSig = 0x08074b50;
constexpr size_t kLocalHeaderSize = 30;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kEocdSize = 22;
constexpr size_t kZip64EocdSize = 56;
constexpr size_t kZip64LocatorSize = 20;

std::array<std::array<uint32_t, 256>, 8> MakeCrcTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
  return t;
}

uint16_t Le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t Le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t Le64(const uint8_t* p) { return Le32(p) | (static_cast<uint64_t>(Le32(p + 4)) << 32); }

void Put16(std::string* out, uint16_t v) {
  out->push_back(static_cast<char>(v & 0xff));
  out->push_back(static_cast<char>(v >> 8));
}
void Put32(std::string* out, uint32_t v) {
  Put16(out, static_cast<uint16_t>(v & 0xffff));
  Put16(out, static_cast<uint16_t>(v >> 16));
}
void Put64(std::string* out, uint64_t v) {
  Put32(out, static_cast<uint32_t>(v & 0xffffffffu));
  Put32(out, static_cast<uint32_t>(v >> 32));
}

// A name must be a relative path without "..", so that no consumer extracting it can escape.
std::string CheckName(std::string_view name) {
  if (name.empty()) return "an entry has an empty name";
  if (name.find('\0') != std::string_view::npos) return "has a NUL byte in its name";
  if (name.find('\\') != std::string_view::npos) return "has a backslash in its name";
  if (name.front() == '/') return "is an absolute path";
  if (name.size() >= 2 && name[1] == ':') return "is an absolute (drive letter) path";
  size_t start = 0;
  while (start <= name.size()) {
    size_t slash = name.find('/', start);
    if (slash == std::string_view::npos) slash = name.size();
    if (name.substr(start, slash - start) == "..") return "has a '..' component";
    start = slash + 1;
  }
  return "";
}

struct Reader {
  std::string_view file;
  const uint8_t* data;
  uint64_t size;

  absl::Status Error(std::string_view problem) const {
    return absl::InvalidArgumentError(Cat(file, ": ", problem));
  }
  absl::Status EntryError(std::string_view entry, std::string_view problem) const {
    return absl::InvalidArgumentError(Cat(file, ": zip entry '", entry, "' ", problem));
  }
  // True if [offset, offset + len) is inside [0, limit).
  static bool Inside(uint64_t offset, uint64_t len, uint64_t limit) {
    uint64_t end;
    return CheckedAdd(offset, len, &end) && end <= limit;
  }
};

}  // namespace

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  static const auto kTables = MakeCrcTables();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (size >= 8) {
    uint32_t lo = c ^ Le32(p);
    uint32_t hi = Le32(p + 4);
    c = kTables[7][lo & 0xff] ^ kTables[6][(lo >> 8) & 0xff] ^ kTables[5][(lo >> 16) & 0xff] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xff] ^ kTables[2][(hi >> 8) & 0xff] ^
        kTables[1][(hi >> 16) & 0xff] ^ kTables[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = kTables[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

absl::StatusOr<ZipArchive> ZipArchive::Open(FileBytes bytes, std::string_view name_for_errors,
                                            const ZipReadOptions& options) {
  Reader r{name_for_errors, bytes.data, bytes.size};
  const uint8_t* d = bytes.data;
  const uint64_t size = bytes.size;
  if (size < kEocdSize) {
    return r.Error(Cat("not a zip file: ", size, " bytes is too short"));
  }

  // End of central directory: the last record whose comment ends exactly at the end of the file.
  uint64_t eocd = 0;
  bool found = false;
  const uint64_t lowest = size > kEocdSize + 0xffff ? size - kEocdSize - 0xffff : 0;
  for (uint64_t pos = size - kEocdSize + 1; pos-- > lowest;) {
    if (Le32(d + pos) == kEocdSig && pos + kEocdSize + Le16(d + pos + 20) == size) {
      eocd = pos;
      found = true;
      break;
    }
  }
  if (!found) {
    return r.Error("not a zip file, or truncated: no end-of-central-directory record");
  }
  uint64_t disk = Le16(d + eocd + 4), cd_disk = Le16(d + eocd + 6);
  uint64_t entries_on_disk = Le16(d + eocd + 8), entry_count = Le16(d + eocd + 10);
  uint64_t cd_size = Le32(d + eocd + 12), cd_offset = Le32(d + eocd + 16);
  uint64_t cd_limit = eocd;  // the central directory must end before this

  const bool has_locator = eocd >= kZip64LocatorSize &&
                           Le32(d + eocd - kZip64LocatorSize) == kZip64LocatorSig;
  const bool needs_zip64 = entry_count == 0xffff || entries_on_disk == 0xffff ||
                           cd_size == 0xffffffffu || cd_offset == 0xffffffffu;
  if (has_locator) {
    const uint8_t* loc = d + eocd - kZip64LocatorSize;
    uint64_t z64 = Le64(loc + 8);
    if (Le32(loc + 4) != 0 || Le32(loc + 16) > 1) return r.Error("multi-disk zip archives are not supported");
    if (!Reader::Inside(z64, kZip64EocdSize, eocd - kZip64LocatorSize)) {
      return r.Error("ZIP64 end-of-central-directory offset is outside the file");
    }
    const uint8_t* rec = d + z64;
    if (Le32(rec) != kZip64EocdSig) return r.Error("ZIP64 end-of-central-directory record is missing");
    disk = Le32(rec + 16);
    cd_disk = Le32(rec + 20);
    entries_on_disk = Le64(rec + 24);
    entry_count = Le64(rec + 32);
    cd_size = Le64(rec + 40);
    cd_offset = Le64(rec + 48);
    cd_limit = z64;
  } else if (needs_zip64) {
    return r.Error("end-of-central-directory record needs ZIP64 but there is no ZIP64 locator");
  }
  if (disk != 0 || cd_disk != 0 || entries_on_disk != entry_count) {
    return r.Error("multi-disk zip archives are not supported");
  }
  if (entry_count > options.max_entries) {
    return r.Error(Cat("zip has ", entry_count, " entries, over the limit of ",
                                options.max_entries));
  }
  if (!Reader::Inside(cd_offset, cd_size, cd_limit)) {
    return r.Error(Cat("central directory [", cd_offset, ", +", cd_size,
                                ") runs outside the file (truncated?)"));
  }
  if (entry_count * kCentralHeaderSize > cd_size) {
    return r.Error(Cat("central directory of ", cd_size, " bytes cannot hold ", entry_count,
                                " entries"));
  }

  ZipArchive archive;
  struct Extent {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Extent> extents;
  const uint64_t cd_end = cd_offset + cd_size;
  uint64_t p = cd_offset;
  for (uint64_t i = 0; i < entry_count; ++i) {
    if (!Reader::Inside(p, kCentralHeaderSize, cd_end) || Le32(d + p) != kCentralSig) {
      return r.Error(Cat("central directory entry ", i, " of ", entry_count,
                                  " is missing or corrupt"));
    }
    const uint8_t* h = d + p;
    const uint16_t flags = Le16(h + 8), method = Le16(h + 10);
    const uint32_t crc = Le32(h + 16);
    uint64_t csize = Le32(h + 20), usize = Le32(h + 24);
    const uint16_t name_len = Le16(h + 28), extra_len = Le16(h + 30), comment_len = Le16(h + 32);
    uint64_t entry_disk = Le16(h + 34);
    uint64_t local = Le32(h + 42);
    const uint64_t var_len = uint64_t{name_len} + extra_len + comment_len;
    if (!Reader::Inside(p + kCentralHeaderSize, var_len, cd_end)) {
      return r.Error(Cat("central directory entry ", i, " runs past the directory"));
    }
    std::string name(reinterpret_cast<const char*>(h + kCentralHeaderSize), name_len);
    if (std::string bad = CheckName(name); !bad.empty()) return r.EntryError(name, bad);
    // ZIP64 extended information: present fields are exactly those saturated in the header.
    const uint8_t* extra = h + kCentralHeaderSize + name_len;
    for (size_t e = 0; e + 4 <= extra_len;) {
      uint16_t id = Le16(extra + e), len = Le16(extra + e + 2);
      if (e + 4 + len > extra_len) return r.EntryError(name, "has a truncated extra field");
      if (id == 0x0001) {
        const uint8_t* f = extra + e + 4;
        size_t left = len;
        auto take = [&](uint64_t* v, size_t width) {
          if (left < width) return false;
          *v = width == 8 ? Le64(f) : Le32(f);
          f += width;
          left -= width;
          return true;
        };
        if ((usize == 0xffffffffu && !take(&usize, 8)) || (csize == 0xffffffffu && !take(&csize, 8)) ||
            (local == 0xffffffffu && !take(&local, 8)) || (entry_disk == 0xffff && !take(&entry_disk, 4))) {
          return r.EntryError(name, "has a ZIP64 extra field too short for its saturated sizes");
        }
      }
      e += 4 + len;
    }
    if (usize == 0xffffffffu || csize == 0xffffffffu || local == 0xffffffffu) {
      return r.EntryError(name, "has saturated sizes but no ZIP64 extra field");
    }
    if (entry_disk != 0) return r.Error("multi-disk zip archives are not supported");
    if (flags & 0x41) return r.EntryError(name, "is encrypted");
    if (method != 0) {
      return r.EntryError(name, Cat("is compressed (method ", method,
                                             method == 8 ? ", deflate" : "",
                                             "); only stored (uncompressed) entries are supported"));
    }
    if (csize != usize) {
      return r.EntryError(name, Cat("is stored but its compressed size ", csize,
                                             " differs from its size ", usize));
    }
    // The local header must agree with the central record.
    if (!Reader::Inside(local, kLocalHeaderSize, cd_offset) || Le32(d + local) != kLocalSig) {
      return r.EntryError(name, Cat("local header at ", local, " is missing or outside the data area"));
    }
    const uint8_t* lh = d + local;
    const uint16_t l_flags = Le16(lh + 6), l_method = Le16(lh + 8);
    const uint16_t l_name_len = Le16(lh + 26), l_extra_len = Le16(lh + 28);
    if (!Reader::Inside(local + kLocalHeaderSize, uint64_t{l_name_len} + l_extra_len, cd_offset)) {
      return r.EntryError(name, "local header runs into the central directory");
    }
    if (std::string_view(reinterpret_cast<const char*>(lh + kLocalHeaderSize), l_name_len) != name) {
      return r.EntryError(name, "local header names a different file");
    }
    if (l_method != method) return r.EntryError(name, "local header disagrees on the compression method");
    const bool descriptor = (flags & 0x08) != 0;
    if (((l_flags ^ flags) & 0x08) != 0) {
      return r.EntryError(name, "local header disagrees on whether a data descriptor follows");
    }
    if (!descriptor) {
      uint64_t l_csize = Le32(lh + 18), l_usize = Le32(lh + 22);
      const uint8_t* lx = lh + kLocalHeaderSize + l_name_len;
      for (size_t e = 0; e + 4 <= l_extra_len;) {
        uint16_t id = Le16(lx + e), len = Le16(lx + e + 2);
        if (e + 4 + len > l_extra_len) return r.EntryError(name, "local header has a truncated extra field");
        if (id == 0x0001 && len >= 16) {
          if (l_usize == 0xffffffffu) l_usize = Le64(lx + e + 4);
          if (l_csize == 0xffffffffu) l_csize = Le64(lx + e + 12);
        }
        e += 4 + len;
      }
      if (Le32(lh + 14) != crc || l_csize != csize || l_usize != usize) {
        return r.EntryError(name, Cat("local header says ", l_usize, " bytes (crc ",
                                               absl::Hex(Le32(lh + 14)), ") but the central directory says ",
                                               usize, " bytes (crc ", absl::Hex(crc), ")"));
      }
    }
    const uint64_t data_offset = local + kLocalHeaderSize + l_name_len + l_extra_len;
    if (!Reader::Inside(data_offset, usize, cd_offset)) {
      return r.EntryError(name, Cat("claims ", usize, " bytes at offset ", data_offset,
                                             ", past the end of the data area (", cd_offset,
                                             " bytes); the file is truncated or the size lies"));
    }
    uint64_t end = data_offset + usize;
    if (descriptor) {
      // Optional signature, CRC, then 4- or 8-byte sizes (8 for ZIP64 entries).
      uint64_t q = end;
      if (Reader::Inside(q, 4, cd_offset) && Le32(d + q) == kDescriptorSig) q += 4;
      bool matched = false;
      if (Reader::Inside(q, 12, cd_offset) && Le32(d + q) == crc && Le32(d + q + 4) == csize &&
          Le32(d + q + 8) == usize) {
        matched = true;
        end = q + 12;
      } else if (Reader::Inside(q, 20, cd_offset) && Le32(d + q) == crc && Le64(d + q + 4) == csize &&
                 Le64(d + q + 12) == usize) {
        matched = true;
        end = q + 20;
      }
      if (!matched) {
        return r.EntryError(name, "data descriptor is missing or disagrees with the central directory "
                                  "(the size lies)");
      }
    }
    if (archive.by_name_.count(name) != 0) return r.EntryError(name, "appears twice");
    archive.by_name_.emplace(name, archive.entries_.size());
    extents.push_back({local, end, archive.entries_.size()});
    archive.entries_.push_back(ZipEntry{std::move(name), local, data_offset, usize, crc});
    p += kCentralHeaderSize + var_len;
  }
  if (p != cd_end) {
    return r.Error(Cat("central directory is ", cd_size, " bytes but its ", entry_count,
                                " entries use ", p - cd_offset));
  }
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i - 1].end > extents[i].begin) {
      return r.EntryError(archive.entries_[extents[i].index].name,
                          Cat("overlaps entry '", archive.entries_[extents[i - 1].index].name,
                                       "' (bytes [", extents[i].begin, ", ", extents[i - 1].end, "))"));
    }
  }
  if (options.verify_crc32) {
    for (const ZipEntry& e : archive.entries_) {
      uint32_t got = Crc32(d + e.data_offset, e.size);
      if (got != e.crc32) {
        return r.EntryError(e.name, Cat("is corrupt: CRC-32 is ", absl::Hex(got, absl::kZeroPad8),
                                                 ", expected ", absl::Hex(e.crc32, absl::kZeroPad8)));
      }
    }
  }
  archive.bytes_ = std::move(bytes);
  return archive;
}

const ZipEntry* ZipArchive::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

std::string_view ZipArchive::Contents(const ZipEntry& entry) const {
  return std::string_view(reinterpret_cast<const char*>(bytes_.data) + entry.data_offset, entry.size);
}

absl::Status WriteZip(const std::vector<ZipSource>& entries, const ZipWriteOptions& options,
                      const ZipSink& sink) {
  std::set<std::string_view> names;
  for (const ZipSource& e : entries) {
    if (std::string bad = CheckName(e.name); !bad.empty()) {
      return absl::InvalidArgumentError(Cat("BuildZip: entry '", e.name, "' ", bad));
    }
    if (e.name.size() > 0xffff) return absl::InvalidArgumentError("BuildZip: entry name too long");
    if (!names.insert(e.name).second) {
      return absl::InvalidArgumentError(Cat("BuildZip: entry '", e.name, "' appears twice"));
    }
  }
  const uint32_t align = std::max<uint32_t>(options.alignment, 1);
  // Headers collect in `out` and go to the sink before each entry's data, which goes straight
  // from the caller's buffer; `pos` counts what the sink has taken.
  std::string out;
  uint64_t pos = 0;
  auto flush = [&]() -> absl::Status {
    if (out.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(sink(out));
    pos += out.size();
    out.clear();
    return absl::OkStatus();
  };
  struct Written {
    uint64_t offset;
    uint32_t crc;
  };
  std::vector<Written> written;
  for (const ZipSource& e : entries) {
    const uint64_t offset = (pos + out.size());
    const uint64_t n = e.data.size();
    const bool zip64 = options.force_zip64 || n >= 0xffffffffu;
    const uint32_t crc = Crc32(e.data.data(), e.data.size());
    Put32(&out, kLocalSig);
    Put16(&out, zip64 ? 45 : 20);  // version needed
    Put16(&out, 0x0800);           // UTF-8 names
    Put16(&out, 0);                // stored
    Put16(&out, 0);                // time
    Put16(&out, 0x21);             // date: 1980-01-01
    Put32(&out, crc);
    Put32(&out, zip64 ? 0xffffffffu : static_cast<uint32_t>(n));
    Put32(&out, zip64 ? 0xffffffffu : static_cast<uint32_t>(n));
    Put16(&out, static_cast<uint16_t>(e.name.size()));
    uint64_t extra = zip64 ? 20 : 0;
    uint64_t pad = 0;
    if (align > 1) {
      uint64_t unpadded = offset + kLocalHeaderSize + e.name.size() + extra + 4;
      pad = (align - unpadded % align) % align;
    }
    Put16(&out, static_cast<uint16_t>(extra + (align > 1 ? 4 + pad : 0)));
    out += e.name;
    if (zip64) {
      Put16(&out, 0x0001);
      Put16(&out, 16);
      Put64(&out, n);
      Put64(&out, n);
    }
    if (align > 1) {
      Put16(&out, 0x4246);  // "FB", as torch's writer pads
      Put16(&out, static_cast<uint16_t>(pad));
      out.append(pad, 'Z');
    }
    RETURN_IF_ERROR(flush());
    if (!e.data.empty()) {
      RETURN_IF_ERROR(sink(e.data));
      pos += e.data.size();
    }
    written.push_back({offset, crc});
  }
  const uint64_t cd_offset = (pos + out.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const ZipSource& e = entries[i];
    const uint64_t n = e.data.size();
    const bool big_size = options.force_zip64 || n >= 0xffffffffu;
    const bool big_offset = options.force_zip64 || written[i].offset >= 0xffffffffu;
    const uint16_t extra = (big_size || big_offset) ? 4 + (big_size ? 16 : 0) + (big_offset ? 8 : 0) : 0;
    Put32(&out, kCentralSig);
    Put16(&out, extra ? 45 : 20);  // made by
    Put16(&out, extra ? 45 : 20);  // needed
    Put16(&out, 0x0800);
    Put16(&out, 0);
    Put16(&out, 0);
    Put16(&out, 0x21);
    Put32(&out, written[i].crc);
    Put32(&out, big_size ? 0xffffffffu : static_cast<uint32_t>(n));
    Put32(&out, big_size ? 0xffffffffu : static_cast<uint32_t>(n));
    Put16(&out, static_cast<uint16_t>(e.name.size()));
    Put16(&out, extra);
    Put16(&out, 0);  // comment
    Put16(&out, 0);  // disk
    Put16(&out, 0);  // internal attributes
    Put32(&out, 0);  // external attributes
    Put32(&out, big_offset ? 0xffffffffu : static_cast<uint32_t>(written[i].offset));
    out += e.name;
    if (extra) {
      Put16(&out, 0x0001);
      Put16(&out, static_cast<uint16_t>(extra - 4));
      if (big_size) {
        Put64(&out, n);
        Put64(&out, n);
      }
      if (big_offset) Put64(&out, written[i].offset);
    }
  }
  const uint64_t cd_size = (pos + out.size()) - cd_offset;
  const uint64_t count = entries.size();
  const bool zip64_end = options.force_zip64 || count >= 0xffff || cd_size >= 0xffffffffu ||
                         cd_offset >= 0xffffffffu;
  if (zip64_end) {
    const uint64_t z64 = (pos + out.size());
    Put32(&out, kZip64EocdSig);
    Put64(&out, kZip64EocdSize - 12);
    Put16(&out, 45);
    Put16(&out, 45);
    Put32(&out, 0);
    Put32(&out, 0);
    Put64(&out, count);
    Put64(&out, count);
    Put64(&out, cd_size);
    Put64(&out, cd_offset);
    Put32(&out, kZip64LocatorSig);
    Put32(&out, 0);
    Put64(&out, z64);
    Put32(&out, 1);
  }
  Put32(&out, kEocdSig);
  Put16(&out, 0);
  Put16(&out, 0);
  Put16(&out, zip64_end ? 0xffff : static_cast<uint16_t>(count));
  Put16(&out, zip64_end ? 0xffff : static_cast<uint16_t>(count));
  Put32(&out, zip64_end ? 0xffffffffu : static_cast<uint32_t>(cd_size));
  Put32(&out, zip64_end ? 0xffffffffu : static_cast<uint32_t>(cd_offset));
  Put16(&out, 0);
  return flush();
}

absl::StatusOr<std::string> BuildZip(const std::vector<ZipSource>& entries,
                                     const ZipWriteOptions& options) {
  std::string out;
  uint64_t total = 0;
  for (const ZipSource& e : entries) total += e.data.size() + e.name.size() * 2 + 200 + options.alignment;
  out.reserve(total);
  RETURN_IF_ERROR(WriteZip(entries, options, [&out](std::string_view bytes) {
    out.append(bytes.data(), bytes.size());
    return absl::OkStatus();
  }));
  return out;
}

}  // namespace collabserve::model::io
